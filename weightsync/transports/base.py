"""The small interface every transport implements.

A transport only moves bucket bytes. Planning, packing, checksums, unpacking, loading and
the version protocol live in the sender, the receiver and the coordinator, so one version
takes the same path through the code whatever the transport.
"""

from __future__ import annotations

import abc
import dataclasses
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from .. import digest
from ..config import SyncConfig
from ..errors import VersionError
from ..manifest import Manifest
from ..plan import BucketPlan, Packing
from .memory import POLL_FIRST_S, Waiter, poll_sleep
from .records import SessionRecord, VersionRecord

if TYPE_CHECKING:
    from ..coordinator.client import ControlPlane

# a received bucket: (index, uint8 bytes of the bucket, the sender's digest or None)
Received = tuple[int, torch.Tensor, "int | None"]


class Aborted(VersionError):
    """The coordinator already aborted the version; its reason names the fault."""


def poll_until(done: Callable[[], bool], deadline: float, on_tick: Callable[[], None],
               timeout: Callable[[], Exception], tick_s: float = 0.2, waiter: Waiter | None = None) -> None:
    """Wait for ``done()``; ``on_tick()`` (e.g. ask the coordinator whether the version was
    aborted) every ``tick_s``; ``timeout()`` is raised at ``deadline``. With a ``waiter`` on the
    word ``done()`` reads, sleep until that word changes (memory.py: futex, or its polling
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
    # what it publishes (transports/records.py): a plugin transport names its own subclasses
    session_record: ClassVar[type[SessionRecord]] = SessionRecord
    version_record: ClassVar[type[VersionRecord]] = VersionRecord

    def __init__(self, ctx: TransportContext):
        self.ctx = ctx
        # the digest of this transport's buckets (None: off), from where its buffers live
        self.digest_kind: str | None = digest.kind_of(ctx.config, self.buffer_device())
        # version -> digest of the whole version (digest.version_digest), once it was packed
        self.version_digests: dict[int, str | None] = {}

    def buffer_device(self) -> torch.device:
        """Where this transport's bucket buffers live (host for shm)."""
        return torch.device("cpu")

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
    # what its sender publishes (transports/records.py), parsed where it arrives
    session_record: ClassVar[type[SessionRecord]] = SessionRecord
    version_record: ClassVar[type[VersionRecord]] = VersionRecord

    def __init__(self, ctx: TransportContext, wire: Mapping[str, Any]):
        """``wire``: the sender's session record as it came over the control plane; a
        malformed one raises ProtocolError naming the transport and the field."""
        self.ctx = ctx
        self.session = self.session_record.from_wire(wire)
        # the sender's digest kind, unless this receiver's own config turns digests off
        self.kind: str | None = (self.session.digest_kind
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

    def plan_of(self, info: VersionRecord) -> BucketPlan:
        """The bucket lengths a version moves, as its record says (VersionRecord.moves)."""
        return info.moves(self.ctx.plan)

    def verify_bucket(self, version: int, info: VersionRecord, b: int, buf: torch.Tensor, expected: int | None) -> bool:
        """Raise ChecksumError if bucket b does not match the sender's digest (None: no
        digest). True if it was digested here; a transport whose receivers share the bytes
        may let one of them verify for all (shm)."""
        if expected is None or self.kind is None:
            return False
        digest.verify(self.kind, b, buf, expected, version)
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
