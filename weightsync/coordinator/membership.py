"""Internal. Who takes part in each broadcast version, and when the collective group must be re-formed.

A collective needs exactly the parties that take part in a version, each knowing its group
rank. Sender rank 0 fixes the group at the barrier (``form``); receivers learn their rank from
it. The group keeps its epoch, and so its communicator, while the member set stays the same
(building an HCCL communicator is slow and, rebuilt every sync, exhausts driver resources); a
new member set, or a failed version (which leaves the old communicator unusable), bumps the
epoch, and the parties re-form under a fresh store prefix. Pure: the actor passes what it knows.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..records import BroadcastGroup

# groups of versions this much older than the newest are forgotten
KEEP_GROUPS = 8


@dataclasses.dataclass(frozen=True)
class Member:
    name: str
    pid: int  # the coordinator's party id: a re-registered party is a new member
    rank: int = 0


@dataclasses.dataclass
class BroadcastGroups:
    epoch: int = 0
    key: list[Any] | None = None
    last: int | None = None  # the version the newest group was formed for
    groups: dict[int, BroadcastGroup] = dataclasses.field(default_factory=dict)

    def form(self, version: int, sender: Member, receivers: list[Member], last_failed: bool,
             nonce: str) -> BroadcastGroup:
        """The group of ``version``: ``sender`` at group rank 0, ``receivers`` after it in
        (rank, name) order. ``last_failed``: the version of the previous group was aborted."""
        members = sorted(receivers, key=lambda m: (m.rank, m.name))
        key = [[sender.pid]] + [[m.name, m.pid] for m in members]
        if key != self.key or last_failed:
            self.epoch += 1
            self.key = key
        self.last = version
        group = BroadcastGroup(epoch=self.epoch, nonce=nonce, sender=sender.name, members=[m.name for m in members],
                               pids={m.name: m.pid for m in members} | {sender.name: sender.pid},
                               size=len(members) + 1)
        self.groups[version] = group
        for old in [k for k in self.groups if k < version - KEEP_GROUPS]:
            del self.groups[old]
        return group

    def get(self, version: int) -> BroadcastGroup | None:
        return self.groups.get(version)


def group_rank(group: BroadcastGroup, name: str) -> int | None:
    """A receiver's rank in ``group`` (the sender is rank 0), or None if it is not a member."""
    return group.members.index(name) + 1 if name in group.members else None
