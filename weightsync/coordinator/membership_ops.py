"""Internal. The coordinator's broadcast-membership operations, owned by ``CoordinatorActor``.

The broadcast transport needs exactly the parties that take part in a version in its
collective group, each knowing its rank; :mod:`weightsync.coordinator.membership` decides the group and its
epoch, these operations wait for it and tell members when the group broke, naming who broke it.
They share the actor's version table, party registry and wake-ups, handed over at construction.
"""

from __future__ import annotations

import dataclasses
import time

from ..errors import DeadlineExceeded, VersionError
from ..records import BroadcastGroup, Formed, GroupCheck, Reason
from .membership import BroadcastGroups, Member, group_rank
from .state import Parties, PartyRecord, Signals, State, VersionTable


class BroadcastMembership:
    def __init__(self, table: VersionTable, parties: Parties, bcast: BroadcastGroups, signals: Signals,
                 session: str):
        self.table, self.parties, self.bcast, self.signals, self.session = table, parties, bcast, signals, session

    async def form(self, sender: PartyRecord, version: int, ahead: bool = False) -> Formed:
        """Sender rank 0, right after begin_sync: fix the group of ``version``. ``ahead``: in
        stage() instead, with every live receiver, if each one's ahead thread is ready to take
        the version into its shadow; else no group and the version goes at the barrier."""
        v = self.table[version]
        if v.state == State.ABORTED:
            raise VersionError(f"version {version} was aborted: {v.reason}")
        if ahead:
            live = [p for p in self.parties.receivers() if not p.rejected]
            if not live or not all(p.ahead and p.verdict == "" for p in live):
                return Formed(group=None)
            members = [Member(p.name, p.pid, p.rank) for p in live]
        else:
            members = [Member(p.name, p.pid, p.rank) for p in self.parties.receivers()
                       if p.name in v.participants and p.name not in v.failed]
        last = self.table.get(self.bcast.last) if self.bcast.last is not None else None
        group = self.bcast.form(version, Member(sender.name, sender.pid), members,
                                last_failed=last is not None and last.state == State.ABORTED, nonce=self.session)
        v.info["group"] = {"epoch": group.epoch, "members": group.members}  # shown in metrics
        self.signals.poke([v.version])
        return Formed(group=group)

    async def group(self, party: PartyRecord, version: int, timeout: float) -> BroadcastGroup:
        """Receivers: wait for the group of ``version``; returns it with this receiver's rank."""
        name = party.name
        deadline = time.monotonic() + timeout
        while self.bcast.get(version) is None:
            v = self.table[version]
            if v.state == State.ABORTED:
                raise VersionError(f"version {version} was aborted: {v.reason}")
            if v.state == State.COMMITTED:
                raise VersionError(f"version {version} committed without receiver '{name}' in its group")
            if time.monotonic() >= deadline:
                raise DeadlineExceeded(f"receiver '{name}' waited {timeout:.1f}s for the sender to reach the "
                                       f"barrier of version {version}")
            self.parties.touch(party.pid, time.monotonic(), False)
            await self.signals.wait(self.signals.version(version), deadline)
        group = self.bcast.get(version)
        rank = group_rank(group, name)
        if rank is None:
            p = self.parties.named("receiver", name)
            why = f" ({p.why})" if p is not None and p.why else ""
            raise VersionError(f"receiver '{name}' is not in the broadcast group of version {version}: it was not a "
                               f"live participant when the sender reached the barrier{why}; it joins the next version")
        return dataclasses.replace(group, rank=rank)

    async def check(self, party: PartyRecord, version: int) -> GroupCheck:
        """Polled by a party whose collective is slow: is the version still on, and who is lost?"""
        name = party.name
        v = self.table[version]
        group = self.bcast.get(version)
        lost = self.parties.lost_members(v, group, name) if group is not None else []
        return GroupCheck(aborted=v.reason if v.state == State.ABORTED else None, lost=lost)

    async def failed(self, party: PartyRecord, version: int, error: str, timeout: float) -> Reason:
        """A member's collective failed: name the party at fault and abort ``version`` for
        everyone, so no member keeps waiting on a broken group. A killed peer shows up as a
        closed connection at once but as a silent party only after heartbeat_timeout_s, so
        this waits up to ``timeout`` for the monitor to name it."""
        name = party.name
        v = self.table[version]
        group = self.bcast.get(version)
        deadline = time.monotonic() + timeout
        lost: list[str] = []
        while group is not None and v.state != State.ABORTED:
            lost = self.parties.lost_members(v, group, name)
            if lost or time.monotonic() >= deadline:
                break
            await self.signals.wait(self.signals.any, deadline)
        if v.state != State.ABORTED:
            epoch = f" (epoch {group.epoch})" if group else ""
            why = "lost " + "; ".join(lost) if lost else f"failed on '{name}': {error}"
            if not self.table.abort(version, f"broadcast group{epoch} {why}", time.monotonic()):
                return Reason(reason=f"broadcast group{epoch} {why}")
            self.signals.poke([v.version])
        return Reason(reason=v.reason)

