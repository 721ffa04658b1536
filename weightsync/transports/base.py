"""Internal. What a transport is: the small interface every transport implements, and the typed records
it publishes.

A transport only moves bucket bytes. Planning, packing, checksums, unpacking, loading and
the version protocol live in the sender, the receiver and the coordinator, so one version
takes the same path through the code whatever the transport.

What a transport's sender publishes for its receivers are two typed records: its session record
(published once with the session: the rendezvous, the digest kind) and its version record (per
version: where the bytes are, their digests). The sender builds them; the coordinator stores and
forwards their wire form (``to_wire()``: plain msgpack-able data) without reading it; each
receiver parses the wire form back with ``from_wire()`` where it arrives. A field missing,
unknown or of the wrong type is a ProtocolError naming the transport and the field, so a sender
and receivers of different weightsync versions fail at the first record, not at a KeyError deep
in a transfer. A plugin transport brings its own records: subclasses of :class:`SessionRecord`
and :class:`VersionRecord` named by its sender and receiver classes (``session_record``,
``version_record``). The built-in transports' records close the module.
"""

from __future__ import annotations

import abc
import dataclasses
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import torch

from .. import digest, records
from ..config import SyncConfig
from ..errors import VersionError
from ..manifest import BucketPlan, Manifest, plan_buckets
from ..packing import Packing
from .wake import POLL_FIRST_S, Waiter, poll_sleep

if TYPE_CHECKING:
    from ..coordinator.client import ControlPlane, Member

DIGEST_KINDS = (None, "xxh3", "torch")
# how a delta version carries each bucket (delta/codec.py encodes them): nothing, the changed
# words, or the whole bucket
SKIP, SPARSE, FULL = "skip", "sparse", "full"
ENCODINGS = (SKIP, SPARSE, FULL)
R = TypeVar("R", bound="Record")


# -- the records a transport publishes ----------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class Record:
    """A typed record with a strict wire form; subclasses name their ``transport``."""

    transport: ClassVar[str] = "transport"
    # keys that others than the sender add to the wire form and the record ignores (see
    # VersionRecord); never a field
    foreign: ClassVar[frozenset[str]] = frozenset()

    def to_wire(self) -> dict[str, Any]:
        """Plain data (dicts, lists, str, int, float, bool, bytes, None) for the control plane."""
        return records.to_wire(self)

    @classmethod
    def from_wire(cls: type[R], wire: Any) -> R:
        """The record of ``wire`` (a ``to_wire()`` form that crossed the control plane).

        Raises:
            ProtocolError: a field is missing, unknown or of the wrong type; names the
                transport and the field.
        """
        return records.from_wire(cls, wire, f"{cls.transport}: {cls.__name__}", cls.foreign)

    def _check(self, name: str, ok: bool, want: str) -> None:
        if not ok:
            raise ValueError(f"field {name!r} is {getattr(self, name)!r}, not {want}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SessionRecord(Record):
    """Published once with the session. Every transport's carries the sender's digest kind."""

    digest_kind: str | None  # of the bucket digests (weightsync.digest), None: off

    def __post_init__(self) -> None:
        self._check("digest_kind", self.digest_kind in DIGEST_KINDS, " / ".join(map(str, DIGEST_KINDS)))


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeltaRecord(Record):
    """A delta version's wire plan (delta/codec.py): per bucket its encoding and the bytes
    that move, and the digest of the whole bucket as the sender packed it, which the bucket a
    receiver rebuilds must match. ``base``: the committed version the deltas apply to (None:
    every bucket is full; receivers keep the version as the base of the next delta)."""

    transport: ClassVar[str] = "delta"
    base: int | None
    kinds: list[str]
    lengths: list[int]
    digests: list[int]  # xxh3 per bucket, unsigned 64-bit

    def __post_init__(self) -> None:
        n = len(self.kinds)
        self._check("lengths", len(self.lengths) == n and all(x >= 0 for x in self.lengths),
                    f"{n} lengths >= 0")
        self._check("digests", len(self.digests) == n and all(0 <= d < 1 << 64 for d in self.digests),
                    f"{n} unsigned 64-bit digests")
        self._check("kinds", all(k in ENCODINGS for k in self.kinds), " / ".join(ENCODINGS) + " per bucket")
        self._check("kinds", self.base is not None or all(k == FULL for k in self.kinds), "full without a base")
        self._check("lengths", all(x == 0 for k, x in zip(self.kinds, self.lengths) if k == SKIP),
                    "0 for a skipped bucket")


@dataclasses.dataclass(frozen=True, kw_only=True)
class VersionRecord(Record):
    """Published per version (stage(): early through ``announce``, whole when staged); the
    coordinator merges the parts, so a field a later part brings has a default."""

    # the coordinator notes a broadcast version's group here for metrics (coordinator/actor.py, bcast_form)
    foreign: ClassVar[frozenset[str]] = frozenset({"group"})
    digest: str | None = None  # of the whole version (digest.version_digest), once packed
    # a delta version's wire plan (the sender's delta: auto / on); None: the session plan
    delta: DeltaRecord | None = None

    def moves(self, plan: BucketPlan) -> BucketPlan:
        """The bucket lengths this version moves over the session ``plan``, bucket for bucket:
        the plan's own, or the encoded lengths its delta record names (BucketPlan.with_lengths), so a
        transport sizes what it reads without knowing what the bytes mean."""
        return plan if self.delta is None else plan.with_lengths(self.delta.lengths)


# -- the interface -----------------------------------------------------------------------------

# a received bucket: (index, uint8 bytes of the bucket, the sender's digest or None: an int, or
# a device value where reading it would wait for the device, as from a broadcast trailer)
Received = tuple[int, torch.Tensor, "int | torch.Tensor | None"]


class Aborted(VersionError):
    """The coordinator already aborted the version; its reason names the fault."""


def poll_until(done: Callable[[], bool], deadline: float, on_tick: Callable[[], None],
               timeout: Callable[[], Exception], tick_s: float = 0.2, waiter: Waiter | None = None) -> None:
    """Wait for ``done()``; ``on_tick()`` (e.g. ask the coordinator whether the version was
    aborted) every ``tick_s``; ``timeout()`` is raised at ``deadline``. With a ``waiter`` on the
    word ``done()`` reads, sleep until that word changes (wake.py: futex, or its polling
    fallback), never past the next tick or the deadline; without one, poll with short sleeps."""
    pause, next_tick = POLL_FIRST_S, time.monotonic() + tick_s
    while True:
        seen = waiter.look() if waiter is not None else 0  # before done(): no lost wake-up
        if done():
            return
        now = time.monotonic()
        if now >= deadline:
            raise timeout()
        if now >= next_tick:
            on_tick()
            next_tick = now + tick_s
        if waiter is not None:
            waiter.sleep(seen, min(next_tick, deadline) - now)
        else:
            pause = poll_sleep(pause)


@dataclasses.dataclass
class TransportContext:
    config: SyncConfig
    plan: BucketPlan
    manifest: Manifest
    digest: str  # manifest digest: segments and groups of another layout are refused
    session: str
    name: str  # this party's name, for error messages
    rank: int
    device: torch.device
    # called with (kind, +1/-1) when a segment or handle is opened or closed (status() shows it)
    account: Callable[[str, int], None] = lambda kind, delta: None
    # the party's typed view of the coordinator (control.ControlPlane), for transports that
    # need membership (broadcast, ipc); None where a transport runs without a coordinator
    control: ControlPlane | None = None
    # host bytes the sender's packing keeps on the node beside the transport's buffers (delta
    # sync's snapshot: delta/strategy.host_reserve); shm's budget leaves them out
    host_reserve: int = 0

    @classmethod
    def for_party(cls, party: Member, manifest: Manifest, digest: str) -> TransportContext:
        """A party's context (the membership a WeightSender or WeightReceiver holds: its config,
        session, name, rank, device, resource accounting and control plane) for its session's
        transport; the bucket plan derived from the manifest by the config, as every party
        derives it (so no plan crosses the wire)."""
        config = party.config
        return cls(config=config, plan=plan_buckets(manifest, config.bucket_bytes, config.align_bytes),
                   manifest=manifest, digest=digest, session=party.session, name=party.name, rank=party.rank,
                   device=party.device, account=party.account, control=party.control)


class SenderTransport(abc.ABC):
    name: ClassVar[str]
    # what the coordinator needs to know of a transport, published with the session (typed, in
    # control.Publication), never read out of the transport's own info:
    # receivers may start reading a version once stage() announced it, while it is still written
    pipelined: ClassVar[bool] = False
    # a committed version stays readable after the sender moved on or died (late joiners catch
    # up from it, a receiver rolls back to it); streaming transports keep nothing
    keeps_versions: ClassVar[bool] = False
    # receive_ahead works here: a version reaches the receivers before the barrier (broadcast
    # sends in stage(); whole-version shm is in its segment, verified ahead)
    ahead_capable: ClassVar[bool] = False
    # how this transport runs here and why (shm: whole versions or a bounded stream), added to
    # the transport reason status() shows; set by the transport
    mode_reason: str = ""
    # what it publishes (the records above): a plugin transport names its own subclasses
    session_record: ClassVar[type[SessionRecord]] = SessionRecord
    version_record: ClassVar[type[VersionRecord]] = VersionRecord

    def __init__(self, ctx: TransportContext):
        self.ctx = ctx
        # the digest of this transport's buckets (None: off), from where they are hashed
        self.digest_kind: str | None = digest.kind_of(ctx.config, self.digest_device())
        # version -> digest of the whole version (digest.version_digest), once it was packed
        self.version_digests: dict[int, str | None] = {}

    def buffer_device(self) -> torch.device:
        """Where this transport's bucket buffers live (host for shm)."""
        return torch.device("cpu")

    def digest_device(self) -> torch.device:
        """Where this transport digests its buckets (config ``digest: auto`` picks the kind for
        it): where its buffers live, unless it hashes them elsewhere on their way (shm on an
        accelerator node: on the device, before the copy to the host)."""
        return self.buffer_device()

    def _record(self, version: int, bucket_digests: list[Any]) -> str | None:
        value = digest.version_digest(self.digest_kind, bucket_digests) if self.digest_kind else None
        self.version_digests = {v: d for v, d in self.version_digests.items() if v > version - 8}
        self.version_digests[version] = value
        return value

    def session_info(self) -> SessionRecord:
        """Published once through the coordinator for every receiver (rendezvous, ...); the
        coordinator passes its wire form on without reading it."""
        return self.session_record(digest_kind=self.digest_kind)

    @abc.abstractmethod
    def stage(self, version: int, slot: int, packing: Packing,
              announce: Callable[[VersionRecord], None]) -> VersionRecord:
        """Pack ``version`` (``packing.into(sink, kind)`` drives this transport's BucketSink,
        now or in send()); may run while receivers are still busy. ``slot`` is the
        coordinator's choice of reusable storage (a transport that keeps no versions ignores
        it). ``announce(record)`` publishes an early record to receivers and makes the version
        readable from then on (pipelined transports).
        Returns the version record receivers need."""

    def send(self, version: int, deadline: float) -> None:
        """The barrier part of a transfer (collectives); nothing for storage transports."""

    def give_back(self, version: int) -> bool:
        """A staged version whose tensors are still to be read at the barrier is given up: they
        are walked once now (the walk may be a collective the other trainer ranks are in) and
        nothing is sent. False where stage() read them already."""
        return False

    def close(self) -> None:
        pass


class ReceiverTransport(abc.ABC):
    name: ClassVar[str]
    # what its sender publishes (the records above), parsed where it arrives
    session_record: ClassVar[type[SessionRecord]] = SessionRecord
    version_record: ClassVar[type[VersionRecord]] = VersionRecord

    def __init__(self, ctx: TransportContext, wire: Mapping[str, Any]):
        """``wire``: the sender's session record as it came over the control plane; a
        malformed one raises ProtocolError naming the transport and the field."""
        self.ctx = ctx
        self.session = self.session_record.from_wire(wire)
        # the sender's digest kind, unless this receiver's own config turns digests off
        self.digest_kind: str | None = (self.session.digest_kind
                                 if digest.kind_of(ctx.config, ctx.device) is not None else None)

    def parse_version(self, wire: Mapping[str, Any]) -> VersionRecord:
        """A version's record from its wire form (the coordinator's Target.info).

        Raises:
            ProtocolError: a field is missing, unknown or of the wrong type.
        """
        return self.version_record.from_wire(wire)

    @abc.abstractmethod
    def receive(self, version: int, info: VersionRecord, deadline: float,
                check: Callable[[], None]) -> Iterator[Received]:
        """Yield the buckets of ``version`` in plan order. A yielded buffer stays valid until
        the next one is requested. ``check()`` raises if the version was aborted; call it
        while waiting. Raise DeadlineExceeded past ``deadline`` (time.monotonic())."""

    def buffers_generation(self) -> int:
        """Changes whenever buffers this transport yielded before were closed or replaced, so
        views of them that outlive a version (the receiver keeps its unpacked views per buffer)
        are dropped instead of keeping the memory mapped. A transport whose buffers never
        change keeps the default."""
        return 0

    def plan_of(self, info: VersionRecord) -> BucketPlan:
        """The bucket lengths a version moves, as its record says (VersionRecord.moves)."""
        return info.moves(self.ctx.plan)

    def verify_bucket(self, version: int, info: VersionRecord, b: int, buf: torch.Tensor,
                      expected: int | torch.Tensor | None, checks: digest.Checks) -> bool:
        """Check bucket b against the sender's digest (None: no digest) through the version's
        ``checks``: at once where it is in host memory (ChecksumError), at the end of the
        version on a device (digest.Checks). True if it was digested here; a transport whose
        receivers share the bytes may let one of them verify for all (shm)."""
        if expected is None or self.digest_kind is None:
            return False
        checks.add(self.digest_kind, b, expected, buf)
        return True

    def prefetch(self, version: int, info: VersionRecord, deadline: float, check: Callable[[], None]) -> bool:
        """Do ahead of apply() what can be done without touching the model (shm: verify the
        checksums). False: nothing to do on this transport (it keeps nothing to read ahead)."""
        return False

    def open_ahead(self) -> int | None:
        """receive_ahead: get ready to take versions before the barrier (allocate a shadow);
        its bytes (0: the transport itself keeps the version, shm), or None where this
        transport takes versions at the barrier only. Raises CapacityError where it does not fit."""
        return None

    def received_ahead(self, version: int, info: VersionRecord) -> bool:
        """True if ``version``'s bytes came in (verified) before the barrier."""
        return False

    def span(self, version: int, info: VersionRecord) -> Callable[[int, int, int], torch.Tensor | None] | None:
        """For transports that hold a whole version at once: a function giving a view of
        ``nbytes`` from ``offset`` in ``bucket`` onwards (None where not contiguous), so tensors
        split over buckets need no reassembly copy. None (the default): reassemble. Asked only
        for a version whose buckets are the session plan's (the receiver's full loader)."""
        return None

    def can_replay(self, version: int, info: VersionRecord) -> bool:
        """True if ``version`` can be received again (rollback after a failed apply). Asked
        only for a version whose buckets are the session plan's (the receiver's full loader)."""
        return False

    def close(self) -> None:
        pass
