"""Internal. The coordinator: one named Ray actor per job, and what it keeps. It never touches tensor bytes.

Parties (senders, receivers) call it through one ``rpc(bytes) -> bytes`` method, through Ray or
over its control channel (:class:`Server`), carrying a request record of
:mod:`weightsync.records` as msgpack (:mod:`weightsync.coordinator.client` is the client side);
every call presents the session token, and parties send heartbeats. Each request type has
exactly one handler here, marked ``@handles(Request)``, which answers with the request's reply
record. A monitor task turns a silent party into an error that names it.

What it keeps comes first in this module, with no Ray and no I/O: the table and the roster have
no clock of their own (callers pass ``now``, time.monotonic()) and the signals are plain asyncio
events, so all of it is tested alone (``tests/test_versions.py``):

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

The actor (:class:`CoordinatorActor`, after them) owns one of each and wraps every call with its
waits: the session registry, liveness, waits with deadlines and wake-ups, and the broadcast
transport's group membership (who takes part in each broadcast version, and who broke a group).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import secrets
import socket
import time
from collections.abc import Awaitable, Callable, Iterable

import ray

from .. import records
from ..config import SyncConfig
from ..errors import (
    DeadlineExceeded,
    ManifestError,
    ProtocolError,
    SessionLost,
    SyncFailed,
    VersionError,
    WeightSyncError,
)
from ..records import (
    FRAME_HEADER,
    HELLO,
    HELLO_MAX,
    MAX_MESSAGE_BYTES,
    BroadcastGroup,
    Device,
    Metrics,
    PartyStatus,
    ReceiverMetrics,
    State,
    WireMap,
    handles,
)
from .staleness import check_staleness

# -- what the coordinator keeps ------------------------------------------------------------------


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
    # a relay version: where each host's relaying party writes it (its name -> segment, size)
    segments: dict[str, tuple[str, int]] = dataclasses.field(default_factory=dict)
    # a sharded version: each other sending rank's part of the record, by its name, once written
    parts: dict[str, WireMap] = dataclasses.field(default_factory=dict)

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
    key: tuple | None = None  # the sender's and members' party ids (and a relay's followers)
    last: int | None = None  # the version the newest group was formed for
    groups: dict[int, BroadcastGroup] = dataclasses.field(default_factory=dict)

    def form(self, version: int, sender: GroupMember, receivers: list[GroupMember], last_failed: bool,
             nonce: str, followers: dict[str, GroupMember] | None = None, heads: int = 1) -> BroadcastGroup:
        """The group of ``version``: ``sender`` at group rank 0, ``receivers`` after it in
        (rank, name) order. ``last_failed``: the version of the previous group was aborted.
        ``followers``: a relay's receivers outside the group, each with the member (or the sender)
        it reads the version from; a change among them re-forms the group too."""
        members = sorted(receivers, key=lambda m: (m.rank, m.name))
        followers = followers or {}
        heads = max(1, min(heads, len(members)))
        # the heads fix who passes buckets to whom (transports/relay/): another count, other pairs
        key = (sender.pid, tuple((m.name, m.pid) for m in members),
               tuple(sorted((n, m.name) for n, m in followers.items())), heads)
        if key != self.key or last_failed:
            self.epoch += 1
            self.key = key
        self.last = version
        group = BroadcastGroup(epoch=self.epoch, nonce=nonce, sender=sender.name, members=[m.name for m in members],
                               pids={m.name: m.pid for m in members} | {sender.name: sender.pid},
                               size=len(members) + 1, followers={n: m.name for n, m in followers.items()},
                               heads=heads)
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



# -- the actor ----------------------------------------------------------------------------------


class Server:
    """The control channel: the coordinator's calls over a plain TCP connection, beside Ray.

    One Ray actor call costs 1-2.5 ms of round trip on a loaded 2-core machine, and a version
    makes several on its critical path (figures: docs/design.md, Parties). This serves the same
    payloads on a port of the actor's own event loop: a frame is a 4-byte big-endian length and
    the msgpack payload exactly as ``CoordinatorActor.rpc`` takes it, and the reply frame is
    exactly what ``rpc`` returns, so the token check and the decoding stay in one place and
    nothing new is unpickled. Each connection serves its frames in order; a client holds one
    connection per thread, so a long poll blocks only its own (``client.Link``).

    The port is reachable from every host of the network, so a connection earns the right to
    send large frames first: its first frame must be ``HELLO`` and the session token, at most
    ``HELLO_MAX`` bytes, within ``HELLO_S`` seconds; anything else closes it before a byte more
    is read. At most ``PENDING_MAX`` connections may be waiting to show the token at once;
    others are closed as they come. So a client without the token costs one small buffer for a
    few seconds, however large the frames it announces.

    ``served``: payloads the handler took, whichever way they came (the actor counts them);
    ``frames``: those that came over the channel; ``refused``: connections closed unproven."""

    HELLO_S = 5.0
    PENDING_MAX = 64

    def __init__(self, handler: Callable[[bytes], Awaitable[bytes]], token: str):
        self.handler = handler
        self._hello = HELLO + token.encode()
        self.served = self.frames = self.refused = 0
        self.pending = 0  # connections that have not shown the token yet
        self._opening: asyncio.Task | None = None
        self._server: asyncio.AbstractServer | None = None

    def via(self) -> dict[str, int]:
        """Payloads served by the way they came (``Status.via``)."""
        return {"ray": self.served - self.frames, "socket": self.frames}

    async def open(self, mode: str) -> records.ChannelAddress:
        """Where the channel listens, from the first call on; ``mode``: the config's
        ``control_channel``.

        Raises:
            ProtocolError: ``mode`` is not "socket": clients keep to Ray.
            WeightSyncError: The port could not be opened (the next ask tries again).
        """
        if mode != "socket":
            raise ProtocolError(f"this coordinator serves no control channel (control_channel: {mode})")
        if self._opening is None:
            # a task, not a plain await: calls asking at once all wait for the one port it opens
            self._opening = asyncio.get_running_loop().create_task(self._start())
        try:
            return await asyncio.shield(self._opening)
        except OSError as exc:
            self._opening = None
            raise WeightSyncError(f"cannot open the control channel: {exc}") from None

    async def _start(self) -> records.ChannelAddress:
        host = ray.util.get_node_ip_address()  # the address other nodes reach this one by
        self._server = await asyncio.start_server(self._serve, host, 0)
        return records.ChannelAddress(host=host, port=self._server.sockets[0].getsockname()[1])

    async def _proven(self, reader: asyncio.StreamReader) -> bool:
        """Whether the connection's first frame is the hello with this session's token."""
        size = int.from_bytes(await reader.readexactly(FRAME_HEADER), "big")
        if size > HELLO_MAX:
            return False  # not read: the announced bytes never reach memory
        return hmac.compare_digest(await reader.readexactly(size), self._hello)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.pending >= self.PENDING_MAX:
            self.refused += 1
            writer.close()
            return
        self.pending += 1
        try:
            try:
                proven = await asyncio.wait_for(self._proven(reader), self.HELLO_S)
            except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError):
                proven = False
            finally:
                self.pending -= 1
            if not proven:
                self.refused += 1
                return
            writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while True:
                size = int.from_bytes(await reader.readexactly(FRAME_HEADER), "big")
                if size > MAX_MESSAGE_BYTES:
                    return  # no way to find the next frame; the client's call goes through Ray instead
                payload = await reader.readexactly(size)
                self.frames += 1
                reply = await self.handler(payload)
                writer.write(len(reply).to_bytes(FRAME_HEADER, "big") + reply)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client closed (its thread ended, or it gave up waiting)
        finally:
            writer.close()


class CoordinatorActor:
    """The actor body. Use :class:`weightsync.Coordinator` to create or reach it."""

    def __init__(self, config: records.WireMap, token: str):
        self.config = SyncConfig.from_mapping(config)
        self.token = token
        self.session = secrets.token_hex(8)
        # party ids carry the incarnation: after a restart, a party still holding an id from
        # before gets SessionLost and registers again, instead of passing for whoever took
        # that small number first in the new session
        self.parties = Parties(first_pid=(int(self.session, 16) >> 32 << 20) + 1)
        self.table = VersionTable()
        self.bcast = BroadcastGroups()
        self.manifest: list[records.Wire] | None = None
        self.digest: str | None = None
        self.payload_bytes = 0
        self.transport: str | None = None
        self.transport_reason = ""
        self.transport_info: records.WireMap = {}  # the transport's own, for receivers only
        self.pipelined = self.keeps_versions = False  # the transport's traits (SenderTransport)
        self.senders = 1  # trainer ranks writing each version (Publication.senders)
        self.resources: dict[str, int] = {}
        self.signals = Signals()
        self._monitor: asyncio.Task | None = None
        # control-plane calls served, by op: status() shows them, so the calls one version
        # costs can be counted (docs/benchmarks.md)
        self.calls: dict[str, int] = {}
        self.channel = Server(self.rpc, token)

    # -- the one entry point -------------------------------------------------------------

    async def rpc(self, payload: bytes) -> bytes:
        if self._monitor is None:
            self._monitor = asyncio.get_running_loop().create_task(self._watch())
        self.channel.served += 1
        try:
            msg = records.decode(payload)
            if not isinstance(msg, dict) or not isinstance(msg.get("op"), str):
                raise ProtocolError("control message must be a map with an 'op'")
            if not hmac.compare_digest(str(msg.get("token", "")), self.token):
                raise ProtocolError(f"op {msg['op']!r} refused: wrong session token for coordinator")
            if (kind := records.REQUESTS.get(msg["op"])) is None:
                raise ProtocolError(f"unknown op {msg['op']!r}")
            self.calls[kind.op] = self.calls.get(kind.op, 0) + 1
            result = await records.HANDLERS[kind](self, kind.from_wire(msg.get("args", {})))
            return records.encode({"ok": True, "type": type(result).__name__, "result": result.to_wire()})
        except WeightSyncError as exc:
            if isinstance(exc, SyncFailed):
                failure = records.Failure(kind="SyncFailed", error=str(exc), failed=exc.failed,
                                          committed=exc.committed, version=exc.version)
            else:
                failure = records.Failure(kind=type(exc).__name__, error=str(exc))
            return records.encode({"ok": False, **failure.to_wire()})
        except TypeError as exc:
            failure = records.Failure(kind="ProtocolError", error=f"bad arguments: {exc}")
            return records.encode({"ok": False, **failure.to_wire()})

    # -- liveness ------------------------------------------------------------------------

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(min(0.25, self.config.heartbeat_interval_s))
            self._check_liveness()

    def _check_liveness(self) -> None:
        for p in self.parties.silent(time.monotonic(), self.config.heartbeat_timeout_s):
            self._party_lost(p)

    def _party_lost(self, p: PartyRecord) -> None:
        now = time.monotonic()
        if p.role == "sender" and p.rank == 0:
            hit = self.table.sender_lost(f"{p.label} {p.why}", self.keeps_versions, now)
        elif p.role == "receiver":
            hit = self.table.receiver_lost(p.name, f"{p.label} {p.why}", now)
            p.reported_dead = p.reported_dead or bool(hit)
        else:  # a sending rank of a sharded session: a version still missing its rows never completes
            hit = self._rows_lost(p, now)
        self._poke(*hit)

    def _rows_lost(self, p: PartyRecord, now: float) -> list[Version]:
        if self.senders <= 1:
            return []
        # on shm the rows go in while v is STAGING, on relay at its barrier: either way v misses them
        hit = [v for v in self.table.in_flight() if v.state in (State.STAGING, State.STAGED, State.TRANSFERRING)
               and p.name not in v.parts]
        for v in hit:
            self.table.abort(v.version, f"{p.label} {p.why} before it wrote its rows", now)
        return hit

    def _poke(self, *versions: Version) -> None:
        self.signals.poke(v.version for v in versions)

    def _party(self, pid: int, seen: bool = True) -> PartyRecord:
        return self.parties.touch(pid, time.monotonic(), seen)

    # -- registration and session --------------------------------------------------------

    @handles(records.Register)
    async def register(self, req: records.Register) -> records.Registered:
        """Join the session. A party re-registering after a coordinator restart brings what
        the coordinator lost: the newest version it staged (senders) or the version it
        serves and where its bytes are (receivers), so versions keep going up and rollback
        data stays pinned."""
        record, replaced = self.parties.add(req.role, req.name, req.rank, req.host, req.os_pid, req.node_id,
                                            req.device, time.monotonic())
        for other in replaced:
            self._party_lost(other)
        if req.last_version is not None:
            self.table.raise_floor(req.last_version)
        if req.serving is not None:
            record.serving = req.serving
            self.table.raise_floor(record.serving)
            if req.served is not None:
                self.table.restore_committed(record.serving, int(req.served.slot or 0), dict(req.served.info),
                                             time.monotonic())
        self._poke()
        return records.Registered(party=record.pid, session=self.session, config=self.config.to_dict())

    @handles(records.Heartbeat)
    async def heartbeat(self, req: records.Heartbeat) -> records.Done:
        self._party(req.party)
        return records.Done()

    @handles(records.Leave)
    async def leave(self, req: records.Leave) -> records.Done:
        p = self.parties.leave(req.party)
        if p is not None:
            self._party_lost(p)
        return records.Done()

    @handles(records.Publish)
    async def publish(self, req: records.Publish) -> records.Done:
        self._party(req.party)
        pub = req.publication
        if self.digest is not None and self.digest != pub.digest:
            raise ManifestError(
                "the sender offers a different manifest than the one this session agreed; "
                "a new layout needs a new coordinator (a new session)"
            )
        self.manifest, self.digest, self.payload_bytes = pub.manifest, pub.digest, pub.payload_bytes
        self.transport, self.transport_reason, self.transport_info = pub.transport, pub.reason, dict(pub.info)
        self.pipelined, self.keeps_versions, self.senders = pub.pipelined, pub.keeps_versions, pub.senders
        self._poke()
        return records.Done()

    @handles(records.Session)
    async def session_of(self, req: records.Session) -> records.SessionInfo:
        deadline = time.monotonic() + req.timeout
        while self.manifest is None:
            if time.monotonic() >= deadline:
                raise DeadlineExceeded(f"no sender published a manifest within {req.timeout:.1f}s")
            self._party(req.party, seen=False)
            await self.signals.wait(self.signals.any, deadline)
        return records.SessionInfo(manifest=self.manifest, digest=self.digest or "", transport=self.transport or "",
                                   info=self.transport_info, session=self.session)

    @handles(records.Receivers)
    async def receivers(self, req: records.Receivers) -> records.Placements:
        deadline = time.monotonic() + req.timeout
        self._party(req.party)
        while True:
            self._party(req.party, seen=False)
            live = self.parties.receivers()
            if len(live) >= req.count:
                return records.Placements(receivers=[
                    records.Placement(name=p.name, rank=p.rank, host=p.host, node_id=p.node_id,
                                      device=p.device, serving=p.serving)
                    for p in live])
            if time.monotonic() >= deadline:
                raise DeadlineExceeded(
                    f"only {len(live)} of {req.count} receivers registered within {req.timeout:.1f}s: "
                    f"{sorted(p.name for p in live)}"
                )
            await self.signals.wait(self.signals.any, deadline)

    @handles(records.Verdict)
    async def verdict(self, req: records.Verdict) -> records.Done:
        p = self._party(req.party)
        p.verdict = "" if req.accepted else (req.why or "rejected")
        if not req.accepted:
            p.why = f"rejected the manifest: {req.why}"
            # a barrier that began before the check came back counted this receiver in: fail
            # those versions now, naming it, instead of waiting for a report that never comes
            for v in self.table.receiver_lost(p.name, f"{p.label} {p.why}", time.monotonic()):
                self._poke(v)
        self._poke()
        return records.Done()

    @handles(records.Resource)
    async def resource(self, req: records.Resource) -> records.Done:
        self._party(req.party)
        self.resources[req.kind] = self.resources.get(req.kind, 0) + req.delta
        return records.Done()

    # -- versions: thin wrappers over the table, adding waits and wake-ups -----------------

    def _slot_for_new_version(self) -> int:
        served = {p.serving for p in self.parties.receivers()}
        pinned = pinned_slots(self.table, served, self.config.keep_previous)
        latest = self.table.latest_committed
        return choose_slot(pinned, self.config.shm_max_segments,
                           self.table.versions[latest].slot if latest is not None else None)

    @handles(records.BeginStage)
    async def begin_stage(self, req: records.BeginStage) -> records.Slot:
        p = self._party(req.party)
        if p.role != "sender" or p.rank != 0:
            raise ProtocolError(f"{p.label} may not stage versions; only sender rank 0 does")
        v, superseded = self.table.begin_stage(req.version, self._slot_for_new_version, time.monotonic())
        self._poke(v, *superseded)
        return records.Slot(slot=v.slot)

    @handles(records.StageInfo)
    async def stage_info(self, req: records.StageInfo) -> records.Done:
        """More per-version info (where the bytes are, the digest once known); ``readable``:
        a pipelined sender announced the version, receivers may start reading it."""
        self._party(req.party)
        v = self.table[req.version]
        v.info.update(req.info)
        v.readable = v.readable or req.readable
        self._poke(v)
        return records.Done()

    @handles(records.Staged)
    async def staged(self, req: records.Staged) -> records.Done:
        self._party(req.party)
        self._poke(self.table.staged(req.version, req.info, req.stage_s))
        return records.Done()

    # -- a sharded version: every sending rank writes its rows, rank 0 collects their parts -----

    @handles(records.BeginPart)
    async def begin_part(self, req: records.BeginPart) -> records.Part:
        p = self._party(req.party)
        if p.role != "sender" or p.rank == 0:
            raise ProtocolError(f"{p.label} may not write a part; sending ranks other than 0 do")
        deadline = time.monotonic() + req.timeout
        while True:
            self._party(req.party, seen=False)
            v = self.table.get(req.version)
            if v is not None and v.state == State.ABORTED:
                raise VersionError(f"version {req.version} was aborted: {v.reason}")
            # rank 0 opened the slot (rows may go in), or staged v for its barrier (its record says
            # where the rows go then: broadcast's, sent ahead or not)
            if v is not None and (v.readable or v.state in (State.STAGED, State.TRANSFERRING)):
                return records.Part(slot=v.slot, info=v.info)
            if v is None and req.version <= max(self.table.floor, max(self.table.versions, default=-1)):
                raise VersionError(f"version {req.version} was never staged by sender rank 0 "
                                   f"(newer versions exist)")
            if time.monotonic() >= deadline:
                raise DeadlineExceeded(f"{p.label} waited {req.timeout:.1f}s for sender rank 0 to open "
                                       f"version {req.version}")
            await self.signals.wait(self.signals.any if v is None else self.signals.version(req.version), deadline)

    @handles(records.PartStaged)
    async def part_staged(self, req: records.PartStaged) -> records.Done:
        p = self._party(req.party)
        v = self.table[req.version]
        v.parts[p.name] = dict(req.info)
        self._poke(v)
        return records.Done()

    @handles(records.WaitParts)
    async def wait_parts(self, req: records.WaitParts) -> records.Parts:
        self._party(req.party)
        deadline = time.monotonic() + req.timeout
        v = self.table[req.version]
        while len(v.parts) < req.count:
            self._party(req.party, seen=False)
            for p in self._silent_writers(v):  # lost before this version began: it never writes its rows
                self.table.abort(req.version, f"{p.label} {p.why} before it wrote its rows", time.monotonic())
                self._poke(v)
            if v.state == State.ABORTED:
                raise VersionError(f"version {req.version} was aborted: {v.reason}")
            if time.monotonic() >= deadline:
                missing = sorted(p.name for p in self.parties.records.values()
                                 if p.role == "sender" and p.rank != 0 and not p.left and p.name not in v.parts)
                reason = (f"sending ranks {missing} did not write their rows of version {req.version} "
                          f"within {req.timeout:.1f}s")
                self.table.abort(req.version, reason, time.monotonic())
                self._poke(v)
                raise VersionError(reason)
            await self.signals.wait(self.signals.version(req.version), deadline)
        if v.state == State.ABORTED:
            raise VersionError(f"version {req.version} was aborted: {v.reason}")
        return records.Parts(parts=[v.parts[n] for n in sorted(v.parts)])

    def _silent_writers(self, v: Version) -> list[PartyRecord]:
        """Sending ranks other than 0 that are dead or gone (their newest registration) and did
        not write their rows of ``v``."""
        names = {p.name for p in self.parties.records.values() if p.role == "sender" and p.rank != 0}
        out = []
        for name in sorted(names - set(v.parts)):
            newest = [p for p in self.parties.records.values() if p.role == "sender" and p.name == name][-1]
            if not newest.present:
                out.append(newest)
        return out

    @handles(records.Abort)
    async def abort(self, req: records.Abort) -> records.Done:
        p = self._party(req.party)
        if self.table.abort(req.version, f"{p.label}: {req.reason}", time.monotonic()):
            self._poke(self.table[req.version])
        return records.Done()

    @handles(records.BeginSync)
    async def begin_sync(self, req: records.BeginSync) -> records.Participants:
        self._party(req.party)
        version = req.version
        eligible = self.parties.at_barrier()
        ahead = self.bcast.get(version) if self.table.get(version) is not None else None
        if ahead is not None and self.table[version].state in (State.STAGING, State.STAGED):
            # its bytes moved before the barrier, to this group: a receiver that joined since
            # takes the next version (as one that joins after a barrier does)
            eligible = [p for p in eligible if p.name in ahead.members]
        offered = [Candidate(p.name, f"{p.label} {p.why}" if not p.alive or p.rejected else None) for p in eligible]
        before = self.table.get(version)
        opening = before is not None and before.state in (State.STAGING, State.STAGED)
        v = self.table.begin_sync(version, offered, time.monotonic())
        if opening:
            for p in eligible:
                p.reported_dead = p.reported_dead or not p.alive  # named in this version, not again
        self._poke(v)
        return records.Participants(participants=list(v.participants), failed=sorted(v.failed))

    @handles(records.WaitVersion)
    async def wait_version(self, req: records.WaitVersion) -> records.Target:
        """Receivers: wait until ``version`` (or, for None, anything newer than what they
        serve) can be read; returns where its bytes are (records.WaitVersion)."""
        version, after, timeout = req.version, req.after, req.timeout
        p = self._party(req.party)
        if req.ahead and not p.ahead:
            p.ahead = True
            self._poke()
        deadline = time.monotonic() + timeout
        while True:
            p = self._party(req.party, seen=False)
            floor = p.serving if after is None else after if p.serving is None else max(after, p.serving)
            target = self.table.target_for(floor, version, pipelined=self.pipelined,
                                           keeps_versions=self.keeps_versions)
            if target is not None:
                v = self.table[target]
                if not req.prefetch:
                    p.applying = target
                return records.Target(version=target, state=v.state.value, slot=v.slot, info=v.info)
            asked = self.table.get(version) if version is not None else None
            if asked is not None and asked.state == State.ABORTED:
                raise VersionError(f"version {version} was aborted: {asked.reason}")
            if not req.wait and (version is None or asked is not None):
                return records.Target(version=None)
            if time.monotonic() >= deadline:
                want = f"version {version}" if version is not None else "a version newer than the one served"
                s0 = self.parties.sender0()
                who = f"; sender: {s0.label}{' ' + s0.why if s0.why else ''}" if s0 else "; no sender registered"
                raise DeadlineExceeded(f"receiver '{p.name}' waited {timeout:.1f}s for {want}{who}")
            await self.signals.wait(self.signals.version(version) if asked is not None else self.signals.any, deadline)

    @handles(records.GetState)
    async def state(self, req: records.GetState) -> records.VersionState:
        self._party(req.party)
        v = self.table[req.version]
        return records.VersionState(state=v.state.value, reason=v.reason, info=v.info)

    @handles(records.Report)
    async def report(self, req: records.Report) -> records.Done:
        p = self._party(req.party)
        p.serving, p.applying = req.serving, None
        v = self.table.report(req.version, p.name, req.ok, f"{p.label}: {req.reason}", req.metrics, time.monotonic())
        if v is not None:
            self._poke(v)
        self._poke()
        return records.Done()

    @handles(records.WaitOutcome)
    async def wait_outcome(self, req: records.WaitOutcome) -> records.Metrics:
        """Wait until ``version`` committed or failed; ``info``: a sender's late stage_info
        (the digest of a transport that packs at the barrier), folded into this call."""
        version, timeout, party = req.version, req.timeout, req.party
        self._party(party)
        deadline = time.monotonic() + timeout
        # trainer ranks other than 0 may get here before rank 0 began the version
        while version not in self.table:
            if time.monotonic() >= deadline or version <= self.table.floor:
                raise VersionError(f"version {version} was never staged (waited {timeout:.1f}s)")
            self._party(party, seen=False)
            await self.signals.wait(self.signals.any, deadline)
        v = self.table[version]
        if req.info:
            v.info.update(req.info)
            self._poke(v)
        while v.in_flight:
            self._party(party, seen=False)
            if time.monotonic() >= deadline:
                self._poke(self.table.expire(version, timeout, time.monotonic()))
                break
            await self.signals.wait(self.signals.version(version), deadline)
        out = v.public(self.payload_bytes)
        if v.state == State.ABORTED:
            raise SyncFailed(version, v.failed or {"sender": v.reason}, v.committed)
        return out

    # -- broadcast membership --------------------------------------------------------------
    # A collective needs exactly the parties that take part in a version, each knowing its group
    # rank: sender rank 0 fixes the group at the barrier (or ahead of it), receivers wait for it
    # and learn their rank; a member whose collective breaks asks who broke it. The group's
    # epoch (state.BroadcastGroups) decides when the communicator must be built again.

    @handles(records.BcastForm)
    async def bcast_form(self, req: records.BcastForm) -> records.Formed:
        """Sender rank 0, right after begin_sync: fix the group of ``version``. ``ahead``: in
        stage() instead, with every live receiver, if each one's ahead thread is ready to take
        the version into its shadow; else no group and the version goes at the barrier."""
        sender = self._party(req.party)
        v = self.table[req.version]
        if v.state == State.ABORTED:
            raise VersionError(f"version {req.version} was aborted: {v.reason}")
        if req.ahead:
            live = [p for p in self.parties.receivers() if not p.rejected]
            if not live or not all(p.ahead and p.verdict == "" for p in live):
                return records.Formed(group=None)
            members = [GroupMember(p.name, p.pid, p.rank) for p in live]
        else:
            members = [GroupMember(p.name, p.pid, p.rank) for p in self.parties.receivers()
                       if p.name in v.participants and p.name not in v.failed]
        followers: dict[str, GroupMember] = {}
        heads = 1
        if self.transport == "relay":
            members, followers = self._hosts(sender, members)
            if self.senders > 1:
                # every trainer host sends its ranks' rows once to each of as many receiving hosts
                # as there are trainer hosts (each takes in one payload, no trainer host sends more
                # than one); the other receiving hosts are fed from those, in chains
                heads = len({p.node_id or p.host for p in self.parties.records.values()
                             if p.role == "sender" and not p.left})
        last = self.table.get(self.bcast.last) if self.bcast.last is not None else None
        group = self.bcast.form(req.version, GroupMember(sender.name, sender.pid), members,
                                last_failed=last is not None and last.state == State.ABORTED, nonce=self.session,
                                followers=followers, heads=heads)
        v.info["group"] = {"epoch": group.epoch, "members": group.members}  # shown in metrics
        self._poke(v)
        return records.Formed(group=group)

    def _hosts(self, sender: PartyRecord, receivers: list[GroupMember]
               ) -> tuple[list[GroupMember], dict[str, GroupMember]]:
        """A relay's members, one receiver per receiving host (the lowest rank there), and every
        other receiver with the party it reads from on its host: that member, or the sender on
        the sender's host. A host is a Ray node (a party's host address without Ray)."""
        def node(name: str, role: str = "receiver") -> str:
            p = self.parties.named(role, name)
            return (p.node_id or p.host) if p is not None else name

        # a sharded session's trainer ranks each hold only their rows: none has a whole bucket to
        # write for receivers beside it, so those are members as on any other host
        home = (sender.node_id or sender.host) if self.senders <= 1 else None
        leaders: dict[str, GroupMember] = {}
        followers: dict[str, GroupMember] = {}
        for m in sorted(receivers, key=lambda m: (m.rank, m.name)):
            where = node(m.name)
            if where == home:
                followers[m.name] = GroupMember(sender.name, sender.pid)
            elif where in leaders:
                followers[m.name] = leaders[where]
            else:
                leaders[where] = m
        return list(leaders.values()), followers

    @handles(records.BcastGroup)
    async def bcast_group(self, req: records.BcastGroup) -> records.BroadcastGroup:
        """Receivers, and a sharded session's other trainer ranks: wait for the group of ``version``;
        returns it with the asking receiver's rank."""
        version = req.version
        party = self._party(req.party)
        name = party.name
        deadline = time.monotonic() + req.timeout
        while self.bcast.get(version) is None:
            v = self.table.get(version)
            # a trainer rank other than 0 may reach the barrier before rank 0 began staging v
            if v is None and party.role != "sender":
                v = self.table[version]  # raises: unknown to this session
            if v is None and version <= max(self.table.floor, max(self.table.versions, default=-1)):
                raise VersionError(f"version {version} was never staged by sender rank 0 (newer versions exist)")
            if v is not None and v.state == State.ABORTED:
                raise VersionError(f"version {version} was aborted: {v.reason}")
            if v is not None and v.state == State.COMMITTED:
                raise VersionError(f"version {version} committed without {party.label} in its group")
            if time.monotonic() >= deadline:
                raise DeadlineExceeded(f"{party.label} waited {req.timeout:.1f}s for sender rank 0 to reach the "
                                       f"barrier of version {version}")
            self._party(req.party, seen=False)
            await self.signals.wait(self.signals.any if v is None else self.signals.version(version), deadline)
        group = self.bcast.get(version)
        if party.role == "sender":
            return group  # a trainer rank of a sharded session: it sends its rows to the first member
        if name in group.followers:
            return dataclasses.replace(group, rank=None)  # a relay follower: it reads its host's copy
        rank = group_rank(group, name)
        if rank is None:
            p = self.parties.named("receiver", name)
            why = f" ({p.why})" if p is not None and p.why else ""
            raise VersionError(f"receiver '{name}' is not in the broadcast group of version {version}: it was not a "
                               f"live participant when the sender reached the barrier{why}; it joins the next version")
        return dataclasses.replace(group, rank=rank)

    @handles(records.BcastCheck)
    async def bcast_check(self, req: records.BcastCheck) -> records.GroupCheck:
        """Polled by a party whose collective is slow: is the version still on, and who is lost?"""
        name = self._party(req.party).name
        v = self.table[req.version]
        group = self.bcast.get(req.version)
        lost = self.parties.lost_members(v, group, name) if group is not None else []
        return records.GroupCheck(aborted=v.reason if v.state == State.ABORTED else None, lost=lost)

    @handles(records.BcastFailed)
    async def bcast_failed(self, req: records.BcastFailed) -> records.Reason:
        """A member's collective failed: name the party at fault and abort ``version`` for
        everyone, so no member keeps waiting on a broken group. A killed peer shows up as a
        closed connection at once but as a silent party only after heartbeat_timeout_s, so
        this waits up to ``timeout`` for the monitor to name it."""
        name = self._party(req.party).name
        v = self.table[req.version]
        group = self.bcast.get(req.version)
        deadline = time.monotonic() + req.timeout
        lost: list[str] = []
        while group is not None and v.state != State.ABORTED:
            lost = self.parties.lost_members(v, group, name)
            if lost or time.monotonic() >= deadline:
                break
            await self.signals.wait(self.signals.any, deadline)
        if v.state != State.ABORTED:
            epoch = f" (epoch {group.epoch})" if group else ""
            why = "lost " + "; ".join(lost) if lost else f"failed on '{name}': {req.error}"
            why = f"{self.transport or 'broadcast'} group{epoch} {why}"
            if not self.table.abort(req.version, why, time.monotonic()):
                return records.Reason(reason=why)
            self._poke(v)
        return records.Reason(reason=v.reason)

    @handles(records.SegmentAt)
    async def segment_at(self, req: records.SegmentAt) -> records.Done:
        """A relaying party (or the sender) writes ``version`` for its host into ``ref``."""
        p = self._party(req.party)
        v = self.table[req.version]
        v.segments[p.name] = (req.ref, req.size)
        self._poke(v)
        return records.Done()

    @handles(records.SegmentOf)
    async def segment_of(self, req: records.SegmentOf) -> records.SegmentRef:
        """A relay follower: wait until the party it reads from says where it writes ``version``."""
        name = self._party(req.party).name
        version = req.version
        deadline = time.monotonic() + req.timeout
        while True:
            v = self.table[version]
            group = self.bcast.get(version)
            leader = group.followers.get(name) if group is not None else None
            if v.state == State.ABORTED:
                raise VersionError(f"version {version} was aborted: {v.reason}")
            if group is not None and leader is None:
                raise VersionError(f"receiver '{name}' reads no host's copy of version {version}: it is not a follower "
                                   f"in its relay (it joined after the barrier, or relays the version itself)")
            if leader is not None and leader in v.segments:
                ref, size = v.segments[leader]
                return records.SegmentRef(leader=leader, ref=ref, size=size)
            if time.monotonic() >= deadline:
                raise DeadlineExceeded(f"receiver '{name}' waited {req.timeout:.1f}s for "
                                       f"{repr(leader) if leader else 'the relay of version ' + str(version)} "
                                       f"to say where version {version} lies on its host")
            self._party(req.party, seen=False)
            await self.signals.wait(self.signals.version(version), deadline)

    # -- staleness (one-step-off) --------------------------------------------------------

    @handles(records.CheckBatch)
    async def check_batch(self, req: records.CheckBatch) -> records.Lag:
        limit = self.config.max_staleness if req.max_staleness is None else req.max_staleness
        check_staleness(req.batch_version, req.step, limit)
        return records.Lag(lag=req.step - req.batch_version)

    @handles(records.Channel)
    async def open_channel(self, req: records.Channel) -> records.ChannelAddress:
        return await self.channel.open(self.config.control_channel)

    # -- reading -------------------------------------------------------------------------

    @handles(records.GetStatus)
    async def status(self, req: records.GetStatus) -> records.Status:
        now = time.monotonic()
        return records.Status(
            session=self.session,
            transport=self.transport, transport_reason=self.transport_reason,
            pipelined=self.pipelined,
            group={k: self.transport_info[k] for k in ("backend", "communicator", "communicator_reason")
                   if k in self.transport_info},
            manifest_tensors=len(self.manifest or ()), payload_bytes=self.payload_bytes,
            latest_committed=self.table.latest_committed,
            parties=self.parties.public(now),
            versions=[v.public(self.payload_bytes) for v in self.table.recent(20)],
            resources=dict(self.resources),
            calls=dict(self.calls),
            via=self.channel.via(),
            config=self.config.to_dict(),
        )

    @handles(records.GetMetrics)
    async def metrics(self, req: records.GetMetrics) -> records.Metrics:
        return self.table[req.version].public(self.payload_bytes)
