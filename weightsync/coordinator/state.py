"""Internal. The coordinator's state and its wake-ups, one job: what the actor knows and how its waiting
ops learn that it changed. No Ray, no I/O: the table and the roster have no clock of their own
(callers pass ``now``, time.monotonic()) and the signals are plain asyncio events; the actor
(actor.py) owns one of each and wraps every call with its waits, so everything here can be
tested alone (``tests/test_versions.py``).

- :class:`VersionTable`: the version state machine. One version moves through

    STAGING --staged--> STAGED --begin_sync--> TRANSFERRING --all reported--> COMMITTED
       \\________________\\______________________\\__ abort / a failure ____--> ABORTED(reason)

  STAGING is the sender still writing (receivers of a pipelined transport may already read);
  STAGED is fully written, waiting for the barrier; TRANSFERRING is the barrier: every receiver
  that takes part (``participants``, fixed at ``begin_sync``) must report. The version commits
  when every participant committed, and aborts when any of them failed, naming each one.
  COMMITTED and ABORTED are final: later calls leave them as they are, so a late or repeated
  report can never turn a finished version around. :func:`choose_slot` picks a new version's
  storage slot.
- :class:`Parties`: the roster, who is in the session (:class:`PartyRecord`) and alive.
- :class:`BroadcastGroups`: who takes part in each broadcast version, and when the collective
  group must be formed again.
- :class:`Signals`: the wake-ups. Every op that changes state pokes, every op that waits
  re-checks its condition after a poke or half a second, whichever comes first.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import time
from collections.abc import Callable, Iterable

from ..errors import ProtocolError, SessionLost, VersionError
from ..records import BroadcastGroup, Device, Metrics, PartyStatus, ReceiverMetrics, WireMap

# -- versions ---------------------------------------------------------------------------------


class State(str, enum.Enum):
    STAGING = "STAGING"
    STAGED = "STAGED"
    TRANSFERRING = "TRANSFERRING"
    COMMITTED = "COMMITTED"
    ABORTED = "ABORTED"

    def __str__(self) -> str:
        return self.value


IN_FLIGHT = frozenset({State.STAGING, State.STAGED, State.TRANSFERRING})


@dataclasses.dataclass
class Version:
    version: int
    state: State
    slot: int
    started: float
    info: WireMap = dataclasses.field(default_factory=dict)
    participants: list[str] = dataclasses.field(default_factory=list)
    committed: list[str] = dataclasses.field(default_factory=list)
    failed: dict[str, str] = dataclasses.field(default_factory=dict)
    reason: str = ""
    phases: dict[str, float] = dataclasses.field(default_factory=dict)
    receivers: dict[str, ReceiverMetrics] = dataclasses.field(default_factory=dict)
    sync_started: float | None = None
    finished: float | None = None
    readable: bool = False  # a pipelined sender announced it: receivers may read while it is written

    @property
    def in_flight(self) -> bool:
        return self.state in IN_FLIGHT

    def unsettled(self) -> list[str]:
        """Participants that neither committed nor failed yet."""
        return [n for n in self.participants if n not in self.committed and n not in self.failed]

    def public(self, payload_bytes: int) -> Metrics:
        barrier = gbps = None
        if self.finished is not None and self.sync_started is not None:
            barrier = self.finished - self.sync_started
            total = self.phases.get("stage_s", 0.0) + barrier
            gbps = payload_bytes / total / 1e9 if total > 0 else None
        return Metrics(
            version=self.version, state=self.state.value, slot=self.slot, reason=self.reason,
            participants=list(self.participants), committed=list(self.committed), failed=dict(self.failed),
            phases_s=dict(self.phases), receivers=dict(self.receivers), bytes=payload_bytes, info=dict(self.info),
            digest=self.info.get("digest"),
            receiver_digests={n: m.digest for n, m in self.receivers.items()},
            barrier_s=barrier, gbps=gbps,
        )


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A receiver offered to a version at its barrier; ``failure`` set: it takes part but has
    already failed (dead, or it rejected the manifest), with the text that names it."""

    name: str
    failure: str | None = None


class VersionTable:
    """Every version of one session, and the rules for moving them."""

    def __init__(self) -> None:
        self.versions: dict[int, Version] = {}
        self.latest_committed: int | None = None
        self.floor = -1  # versions at or below this were used before a coordinator restart

    def __contains__(self, version: object) -> bool:
        return version in self.versions

    def get(self, version: int) -> Version | None:
        return self.versions.get(version)

    def __getitem__(self, version: int) -> Version:
        v = self.versions.get(version)
        if v is None:
            raise VersionError(f"version {version} is unknown to this session")
        return v

    def in_flight(self) -> list[Version]:
        return [v for v in self.versions.values() if v.in_flight]

    def recent(self, n: int) -> list[Version]:
        return [self.versions[k] for k in sorted(self.versions)[-n:]]

    def raise_floor(self, version: int) -> None:
        """A party that outlived a coordinator restart used ``version``: never reuse it."""
        self.floor = max(self.floor, int(version))

    def restore_committed(self, version: int, slot: int, info: WireMap, now: float) -> None:
        """A receiver that outlived a restart serves ``version``: its bytes stay pinned."""
        self.raise_floor(version)
        if version not in self.versions:
            self.versions[version] = Version(version, State.COMMITTED, slot, now, info=dict(info))
            self._committed(version)

    # -- transitions ---------------------------------------------------------------------

    def begin_stage(self, version: int, slot_for: Callable[[], int], now: float) -> tuple[Version, list[Version]]:
        """A new version in STAGING; returns it and the versions it superseded (aborted).
        ``slot_for()`` picks its storage slot once the superseded versions gave theirs up.

        Raises:
            VersionError: ``version`` is not newer than every version of the session, or a
                version is still transferring.
        """
        self.check_new(version)
        superseded = [v for v in self.versions.values() if v.state in (State.STAGING, State.STAGED)]
        for v in superseded:
            self.abort(v.version, f"superseded by version {version} before its sync", now)
        self.versions[version] = Version(version, State.STAGING, slot_for(), now)
        return self.versions[version], superseded

    def check_new(self, version: int) -> None:
        newest = max(max(self.versions, default=self.floor), self.floor)
        if newest >= 0 and version <= newest:
            what = "is reused" if version in self.versions else "goes backwards"
            raise VersionError(f"version {version} {what}: the newest version of this session is {newest}")
        for v in self.versions.values():
            if v.state == State.TRANSFERRING:
                raise VersionError(f"version {version} cannot start while version {v.version} is still transferring")

    def staged(self, version: int, info: WireMap, stage_s: float) -> Version:
        """The sender wrote the whole version. An aborted version stays aborted."""
        v = self[version]
        if v.state == State.STAGING:
            v.state = State.STAGED
        v.info.update(info)
        v.phases["stage_s"] = stage_s
        return v

    def abort(self, version: int, reason: str, now: float) -> bool:
        """Abort an in-flight version; every participant not yet committed fails with the
        reason. False (and nothing changes) for a finished or unknown version."""
        v = self.versions.get(version)
        if v is None or not v.in_flight:
            return False
        v.state, v.reason, v.finished = State.ABORTED, reason, now
        for name in v.participants:
            if name not in v.committed:
                v.failed.setdefault(name, f"version aborted: {reason}")
        return True

    def begin_sync(self, version: int, receivers: Iterable[Candidate], now: float) -> Version:
        """The barrier: fix the participants. Idempotent for a version already at or past it.

        Raises:
            VersionError: the version was never staged, or was aborted before its barrier.
        """
        v = self.versions.get(version)
        if v is None:
            raise VersionError(f"sync({version}) was called but version {version} was never staged")
        if v.state == State.ABORTED:
            raise VersionError(f"version {version} was aborted while staging: {v.reason}")
        if v.state in (State.STAGING, State.STAGED):
            v.state, v.sync_started = State.TRANSFERRING, now
            offered = list(receivers)
            v.participants = sorted(c.name for c in offered)
            v.failed.update({c.name: c.failure for c in offered if c.failure is not None})
            self._maybe_finish(v, now)
        return v

    def report(self, version: int, name: str, ok: bool, failure: str, metrics: ReceiverMetrics | None,
               now: float) -> Version | None:
        """A receiver's outcome for ``version`` (``failure``: the text naming it when not ok;
        ``metrics``: what it measured, where it has any). A success after a failure on a still
        open version clears the failure (a retry); a finished version keeps its state."""
        v = self.versions.get(version)
        if v is None:
            return None
        if metrics is not None:
            v.receivers[name] = metrics
        if ok:
            if name not in v.committed:
                v.committed.append(name)
            if v.in_flight:
                v.failed.pop(name, None)
        elif name in v.participants or not v.participants:
            v.failed[name] = failure
        self._maybe_finish(v, now)
        return v

    def receiver_lost(self, name: str, failure: str, now: float) -> list[Version]:
        """A receiver died, stalled or left: it fails every in-flight version it takes part in
        and has not settled. Returns those versions."""
        hit = []
        for v in self.in_flight():
            if name in v.unsettled():
                v.failed[name] = failure
                self._maybe_finish(v, now)
                hit.append(v)
        return hit

    def sender_lost(self, reason: str, keeps_versions: bool, now: float) -> list[Version]:
        """Sender rank 0 died or left. A version still being written can never complete; one
        fully staged in storage that keeps versions (shm) can, and is settled by the
        receivers' reports; on a streaming transport the bytes die with the sender."""
        hit = [v for v in self.in_flight() if v.state == State.STAGING or not keeps_versions]
        for v in hit:
            self.abort(v.version, reason, now)
        return hit

    def expire(self, version: int, timeout: float, now: float) -> Version:
        """The sender's wait for the outcome ran out: a version not yet at its barrier is
        aborted; at the barrier, every participant that has not reported fails, named."""
        v = self[version]
        if not v.in_flight:
            return v
        if v.state != State.TRANSFERRING:
            self.abort(version, f"version {version} did not reach the barrier within {timeout:.1f}s", now)
            return v
        for name in v.unsettled():
            v.failed[name] = f"receiver '{name}' did not report version {version} within {timeout:.1f}s"
        self._maybe_finish(v, now)
        return v

    def _maybe_finish(self, v: Version, now: float) -> None:
        if v.state != State.TRANSFERRING or v.unsettled():
            return
        v.finished = now
        if v.failed:
            v.state = State.ABORTED
            v.reason = "; ".join(f"{n}: {why}" for n, why in sorted(v.failed.items()))
        else:
            v.state = State.COMMITTED
            self._committed(v.version)

    def _committed(self, version: int) -> None:
        if self.latest_committed is None or version > self.latest_committed:
            self.latest_committed = version

    # -- queries -------------------------------------------------------------------------

    def target_for(self, serving: int | None, version: int | None, *, pipelined: bool,
                   keeps_versions: bool) -> int | None:
        """What a receiver serving ``serving`` should read when it asks for ``version`` (None:
        anything newer), or None while there is nothing readable yet."""
        if version is not None:
            v = self.versions.get(version)
            return version if v is not None and v.state != State.ABORTED and _readable(v, pipelined) else None
        flight = [v.version for v in self.in_flight()]
        if flight and (serving is None or flight[-1] > serving):
            # a version on its way beats the committed one: wait for it rather than load twice
            return flight[-1] if _readable(self.versions[flight[-1]], pipelined) else None
        if not keeps_versions:
            return None  # a streaming transport keeps nothing: late receivers join the next version
        cand = self.latest_committed
        if cand is None or (serving is not None and cand <= serving):
            return None
        return cand


def _readable(v: Version, pipelined: bool) -> bool:
    return v.state != State.STAGING or (pipelined and v.readable)


# -- which storage slot a new version takes (transports that keep versions: shm segments) --
# A slot stays pinned while a version in it is in flight, is the latest committed one (late
# joiners and catch-up read it), or, with ``keep_previous``, is what a live receiver serves (its
# rollback). A new version takes the lowest free slot; when all ``max_slots`` are pinned it takes
# the lowest slot that does not hold the latest committed version, and the receiver serving
# what was there loses its rollback (it still serves the weights it loaded).


def pinned_slots(table: VersionTable, served: Iterable[int], keep_previous: bool) -> set[int]:
    """Slots that must not be overwritten. ``served``: versions live receivers serve."""
    keep = {v.slot for v in table.in_flight()}
    if keep_previous:
        keep |= {table.versions[s].slot for s in served if s in table.versions}
    if table.latest_committed is not None:
        keep.add(table.versions[table.latest_committed].slot)
    return keep


def choose_slot(pinned: set[int], max_slots: int, latest_slot: int | None) -> int:
    slot = next(i for i in range(len(pinned) + 1) if i not in pinned)
    if slot >= max_slots:
        slot = next(i for i in range(max_slots) if i != latest_slot)
    return slot


# -- roster: who is in the session ------------------------------------------------------------


@dataclasses.dataclass
class PartyRecord:
    """What the coordinator knows of one registered party."""

    pid: int  # party id within the session
    name: str
    role: str  # "sender" | "receiver"
    rank: int
    host: str
    os_pid: int
    node_id: str
    device: Device | None
    last_seen: float
    alive: bool = True
    left: bool = False
    serving: int | None = None  # receivers: the version whose weights they hold, complete
    applying: int | None = None
    verdict: str | None = None  # receivers: None until they checked the manifest, "" if accepted
    why: str = ""
    # a dead party is named in the first version it fails; later versions go on without it
    # (until it comes back or is replaced) instead of failing again for the same reason
    reported_dead: bool = False
    # receivers: an ahead thread waits for versions (config receive_ahead), with its shadow ready
    ahead: bool = False

    @property
    def present(self) -> bool:
        return self.alive and not self.left

    @property
    def rejected(self) -> bool:
        return self.verdict not in (None, "")

    @property
    def label(self) -> str:
        return f"{self.role} '{self.name}' (rank {self.rank}, pid {self.os_pid} on {self.host})"

    def public(self, now: float) -> PartyStatus:
        return PartyStatus(
            name=self.name, role=self.role, rank=self.rank, host=self.host, node_id=self.node_id,
            pid=self.os_pid, alive=self.present, left=self.left, serving=self.serving,
            applying=self.applying, silent_s=round(now - self.last_seen, 3),
            manifest="pending" if self.verdict is None else ("accepted" if self.verdict == "" else "rejected"),
            why=self.why, ahead=self.ahead,
        )


class Parties:
    def __init__(self, first_pid: int):
        self.records: dict[int, PartyRecord] = {}
        self._next_pid = first_pid

    def add(self, role: str, name: str, rank: int, host: str, os_pid: int, node_id: str,
            device: Device | None, now: float) -> tuple[PartyRecord, list[PartyRecord]]:
        """Register a party; returns it and the parties of the same name it replaced (the
        newest registration wins: a restarted worker takes its name back at once instead of
        waiting for its dead predecessor's heartbeat to time out)."""
        if role not in ("sender", "receiver"):
            raise ProtocolError(f"role must be 'sender' or 'receiver', got {role!r}")
        replaced = [p for p in self.records.values() if p.name == name and not p.left]
        for other in replaced:
            other.left, other.why = True, f"replaced by a new registration (pid {os_pid})"
        record = PartyRecord(self._next_pid, name, role, int(rank), host, int(os_pid), node_id, device, now)
        self.records[record.pid] = record
        self._next_pid += 1
        return record, replaced

    def touch(self, pid: int, now: float, seen: bool = True) -> PartyRecord:
        """The party behind ``pid`` made a call: it is alive (a stalled party came back).
        ``seen=False``: a re-check inside a long wait; the call arrived once, and a party
        killed while it waits (a sender in wait_outcome) must still go silent."""
        p = self.records.get(pid)
        if p is None:
            raise SessionLost(f"party {pid} is not registered in this session (coordinator restarted?)")
        if p.left:
            raise ProtocolError(f"{p.label} is no longer in the session: {p.why}")
        if not seen:
            return p
        p.last_seen = now
        if not p.alive:
            p.alive, p.why, p.reported_dead = True, "", False
        return p

    def leave(self, pid: int) -> PartyRecord | None:
        p = self.records.get(pid)
        if p is None or p.left:
            return None
        p.left, p.why = True, "left the session"
        return p

    def silent(self, now: float, limit: float) -> list[PartyRecord]:
        """Mark parties silent for more than ``limit`` seconds dead; returns them."""
        found = []
        for p in self.records.values():
            if p.present and now - p.last_seen > limit:
                p.alive = False
                p.why = f"silent for {now - p.last_seen:.1f}s (dead or stalled; heartbeat_timeout_s={limit})"
                found.append(p)
        return found

    def named(self, role: str, name: str) -> PartyRecord | None:
        found = [p for p in self.records.values() if p.role == role and p.name == name and not p.left]
        return found[-1] if found else None

    def receivers(self) -> list[PartyRecord]:
        """Live receivers, by rank."""
        return sorted((p for p in self.records.values() if p.role == "receiver" and p.present), key=lambda p: p.rank)

    def at_barrier(self) -> list[PartyRecord]:
        """Receivers a version's barrier offers itself to: all that are in the session, except
        dead ones already named in an earlier version."""
        return [p for p in self.records.values()
                if p.role == "receiver" and not p.left and not (p.reported_dead and not p.alive)]

    def sender0(self) -> PartyRecord | None:
        found = [p for p in self.records.values() if p.role == "sender" and p.rank == 0]
        return found[-1] if found else None

    def lost_members(self, v: Version, group: BroadcastGroup, caller: str) -> list[str]:
        """Members of broadcast ``group`` (other than ``caller``) that died, left, or failed ``v``."""
        lost = []
        for role, name in [("sender", group.sender)] + [("receiver", n) for n in group.members]:
            if name == caller:
                continue
            p = self.named(role, name)
            if p is None or p.pid != group.pids.get(name, p.pid):
                lost.append(f"{role} '{name}' left the session")
            elif not p.alive:
                lost.append(f"{p.label} {p.why}")
            elif name in v.failed and not v.failed[name].startswith("version aborted"):
                lost.append(v.failed[name])
        return lost

    def public(self, now: float) -> list[PartyStatus]:
        return [p.public(now) for p in sorted(self.records.values(), key=lambda p: (p.role, p.rank, p.pid))
                if not p.left]


# -- broadcast groups: who takes part in each broadcast version --------------------------------
# A collective needs exactly the parties that take part in a version, each knowing its group
# rank. Sender rank 0 fixes the group at the barrier (``form``); receivers learn their rank from
# it. The group keeps its epoch, and so its communicator, while the member set stays the same
# (building an HCCL communicator is slow and, rebuilt every sync, exhausts driver resources); a
# new member set, or a failed version (which leaves the old communicator unusable), bumps the
# epoch, and the parties re-form under a fresh store prefix.

# groups of versions this much older than the newest are forgotten
KEEP_GROUPS = 8


@dataclasses.dataclass(frozen=True)
class GroupMember:
    name: str
    pid: int  # the coordinator's party id: a re-registered party is a new member
    rank: int = 0


@dataclasses.dataclass
class BroadcastGroups:
    epoch: int = 0
    key: tuple[int, tuple[tuple[str, int], ...]] | None = None  # the sender's and members' party ids
    last: int | None = None  # the version the newest group was formed for
    groups: dict[int, BroadcastGroup] = dataclasses.field(default_factory=dict)

    def form(self, version: int, sender: GroupMember, receivers: list[GroupMember], last_failed: bool,
             nonce: str) -> BroadcastGroup:
        """The group of ``version``: ``sender`` at group rank 0, ``receivers`` after it in
        (rank, name) order. ``last_failed``: the version of the previous group was aborted."""
        members = sorted(receivers, key=lambda m: (m.rank, m.name))
        key = (sender.pid, tuple((m.name, m.pid) for m in members))
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


# -- signals: wake-ups inside the actor -------------------------------------------------------


class Signals:
    """One event for "anything changed", one per version for "this version changed"."""

    def __init__(self) -> None:
        self.any = asyncio.Event()
        self._versions: dict[int, asyncio.Event] = {}

    def poke(self, versions: Iterable[int] = ()) -> None:
        # a set event is replaced, not cleared: a waiter that took the old one still wakes
        self.any.set()
        self.any = asyncio.Event()
        for v in versions:
            event = self._versions.pop(v, None)
            if event is not None:
                event.set()

    def version(self, version: int) -> asyncio.Event:
        return self._versions.setdefault(version, asyncio.Event())

    @staticmethod
    async def wait(event: asyncio.Event, deadline: float) -> None:
        """Until ``event`` is set, ``deadline`` passes, or half a second: callers loop."""
        left = deadline - time.monotonic()
        if left <= 0:
            return
        try:
            await asyncio.wait_for(event.wait(), timeout=min(left, 0.5))
        except asyncio.TimeoutError:
            pass
