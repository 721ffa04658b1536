"""Internal. The transport contract: what moves one version's bucket bytes from the sender to its
receivers, and nothing else.

Planning, packing, checksums, unpacking, loading and the version protocol live in the sender,
the receiver and the coordinator, so one version takes the same path through the code whatever
the transport. A transport is two small classes:

- :class:`SenderTransport`: ``stage`` (pack the version: now, or keep the packer for the
  barrier), ``send`` (the barrier's part), ``close``;
- :class:`ReceiverTransport`: ``receive`` (the version's buckets, in plan order), ``close``.

What only some transports can do is a small Protocol that the sender or the receiver checks
once, with ``isinstance``: :class:`Announces` (receivers may read a version while it is being
staged), :class:`GivesBack` (a staged version can be given up unsent), :class:`Prefetches`
(verify a version ahead of the barrier), :class:`ReceivesAhead` (take whole versions before
the barrier), :class:`Replays` (a version stays readable: rollback, catch-up), :class:`Spans`
(a whole version lies in one buffer: split tensors need no reassembly).

A transport says what its receivers need in two typed records (``records.py`` holds their
bases): its session record, published once (rendezvous, digest kind), and a version record per
version (where the bytes are). The coordinator stores and forwards their wire forms without
reading them. A transport is declared by a :class:`Transport` entry: its name, how to build
each end, how to parse its records, and its rules for ``auto``; ``transports/__init__.py``
lists the built-in ones.

This module imports no torch: a declaration is read where only a config is checked.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, runtime_checkable

from ..errors import DeadlineExceeded, VersionError
from ..records import SessionRecord, VersionRecord

if TYPE_CHECKING:
    import torch

    from ..config import SyncConfig
    from ..coordinator.client import ControlPlane, Member
    from ..manifest import BucketPlan, Manifest, Packer

# a view of ``nbytes`` from ``offset`` in ``bucket`` on through the next buckets, or None where
# they do not lie back to back
Span = Callable[[int, int, int], "torch.Tensor | None"]


class Aborted(VersionError):
    """The coordinator already aborted the version; its reason names the fault."""


@dataclasses.dataclass
class TransportContext:
    """What one end of a transport knows of its session and its party."""

    config: SyncConfig
    plan: BucketPlan  # derived from the manifest by every party, so no plan crosses the wire
    manifest: Manifest
    digest: str  # the manifest's: segments and groups of another layout are refused
    session: str
    name: str  # this party's name, for error messages
    rank: int
    device: torch.device
    # the party's membership: its control plane (membership, abort checks) and the resources
    # it accounts for (status() shows segments and handles held); None without a coordinator
    member: Member | None = None
    # the digest this end checks (receivers: None where this receiver's config turns them off)
    digest_kind: str | None = None
    # host bytes the sender keeps on the node beside the transport's buffers (delta sync's
    # snapshot); shm's budget leaves them out
    host_reserve: int = 0

    @property
    def control(self) -> ControlPlane | None:
        return self.member.control if self.member is not None else None

    def account(self, kind: str, delta: int) -> None:
        """A segment or handle opened (+1) or closed (-1): status() shows what each party holds."""
        if self.member is not None:
            self.member.account(kind, delta)


@dataclasses.dataclass(frozen=True)
class Deadline:
    """How long a transport may wait for a version, and whom it asks meanwhile whether the
    version is still on: a transport that waits calls ``check()`` every so often."""

    version: int
    at: float  # time.monotonic()
    control: ControlPlane | None = None  # None: nobody to ask (a replay of a version already complete)

    def left(self) -> float:
        return self.at - time.monotonic()

    def passed(self) -> bool:
        return time.monotonic() >= self.at

    def check(self) -> None:
        """Raise Aborted once the coordinator aborted the version."""
        if self.control is not None:
            state = self.control.state(self.version)
            if state.state == "ABORTED":
                raise Aborted(f"version {self.version} was aborted: {state.reason}")

    def expired(self, what: str) -> DeadlineExceeded:
        return DeadlineExceeded(f"{what} before the deadline")


class Bucket(NamedTuple):
    """One received bucket, as ``receive`` yields it."""

    index: int
    data: Any  # torch.Tensor, uint8: valid until the next bucket is asked for
    # the sender's digest of these bytes: an int, or a device value whose reading would wait for
    # the device (a broadcast trailer); None: none sent
    digest: Any = None
    # who checked ``data`` against ``digest`` already: "" nobody (the receiver does), "here" this
    # transport (on its way in), "peer" another receiver of the node, over these very bytes
    checked: str = ""
    # changes whenever buffers yielded before were closed or replaced: views of them that a
    # receiver keeps across versions must go
    generation: int = 0


class SenderTransport(abc.ABC):
    """The sender's end. ``session`` (set by the constructor) is what receivers need to join;
    its ``digest_kind`` is the digest of the buckets this end sends."""

    session: SessionRecord

    @abc.abstractmethod
    def stage(self, version: int, slot: int, packer: Packer) -> VersionRecord:
        """Pack ``version`` now (``packer.fill`` bucket by bucket) or keep the packer for
        ``send``; may run while receivers are still busy. ``slot``: the coordinator's choice of
        reusable storage (ignored by a transport that keeps no versions). Returns the record
        receivers need, with the version's ``digest`` where the bytes were packed here."""

    @abc.abstractmethod
    def send(self, version: int, deadline: Deadline) -> str | None:
        """The barrier's part of a transfer; the version's digest where its bytes were packed
        here, None where they were packed in ``stage`` (or digests are off, or the coordinator
        aborted the version: it has the reason, and sync() raises it)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release every buffer, segment and group."""


class ReceiverTransport(abc.ABC):
    """A receiver's end, built from the sender's session record."""

    @abc.abstractmethod
    def receive(self, version: int, record: VersionRecord, deadline: Deadline) -> Iterator[Bucket]:
        """The buckets of ``version`` in plan order, with the lengths its record says
        (``record.moves(plan)``). Raise DeadlineExceeded past the deadline, Aborted where the
        coordinator gave the version up (``deadline.check()`` while waiting)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release every mapping, buffer and group."""


# -- abilities: small protocols a transport may add ----------------------------------------------


@runtime_checkable
class Announces(Protocol):
    """Receivers may read a version while the sender still stages it (shm: each bucket as soon
    as it is written; broadcast with receive_ahead: the collective runs in stage())."""

    def announce(self, version: int, slot: int) -> VersionRecord | None:
        """Before ``stage``: the record receivers may start reading with (None: nothing to
        read before the version is staged)."""


@runtime_checkable
class GivesBack(Protocol):
    """A staged version whose tensors are still to be read at the barrier can be given up."""

    def give_back(self, version: int) -> bool:
        """Walk the kept tensors once without sending (the walk may be a collective the other
        trainer ranks are in). False where ``stage`` read them already."""


@runtime_checkable
class Prefetches(Protocol):
    """A version can be verified ahead of the barrier, so the barrier only loads."""

    def prefetch(self, version: int, record: VersionRecord, deadline: Deadline) -> bool:
        """True if ``version`` was read (and verified) ahead."""


@runtime_checkable
class ReceivesAhead(Protocol):
    """Whole versions can come in before their barrier (config ``receive_ahead``): a thread of
    the receiver takes each one with ``prefetch`` while the engine serves the one before."""

    def open_ahead(self) -> int | None:
        """Get ready to take versions ahead; the bytes that takes (0: the transport holds the
        version anyway), None where it cannot. Raises CapacityError where it does not fit."""

    def prefetch(self, version: int, record: VersionRecord, deadline: Deadline) -> bool:
        """Take ``version`` ahead; True if it came in whole and verified."""

    def received_ahead(self, version: int, record: VersionRecord) -> bool:
        """Whether ``version``'s bytes came in before the barrier."""


@runtime_checkable
class Replays(Protocol):
    """A committed version stays readable (shm's segments): a receiver that failed part-way
    loads the previous version again with ``receive``."""

    def can_replay(self, version: int, record: VersionRecord) -> bool:
        """Whether ``version`` can be received again now."""


@runtime_checkable
class Spans(Protocol):
    """A whole version lies in one buffer, so a tensor split over buckets is one view."""

    def span(self, version: int, record: VersionRecord) -> Span | None:
        """A view function over ``version`` (None: reassemble split tensors)."""


# -- declaring a transport --------------------------------------------------------------------

COLOCATED, SAME_NODE, REMOTE = "colocated", "same node", "remote"


@dataclasses.dataclass(frozen=True)
class Facts:
    """Where a session's parties are, as the rules of ``auto`` read them (transports/__init__.py
    computes them)."""

    sender: Any  # records.Placement
    receivers: Sequence[Any]  # the receivers' Placements, by rank
    where: list[str]  # per receiver: COLOCATED, SAME_NODE or REMOTE
    device: str  # the sender's device type ("cpu", "cuda", ...)
    on_device: str  # the sender's device as people read it ("physical cuda 0", "host")
    node: str  # the sender's node as people read it
    far: str  # the other nodes, as people read them
    clash: str | None  # why a device collective cannot hold these ranks (None: it can, or gloo)
    # whether the sender can share device buckets by handle (an IpcSupport: ok, reason), probed
    # only when a rule asks: on a CPU node no built-in rule does
    probe_ipc: Callable[[], Any] = lambda: None

    @functools.cached_property
    def ipc(self) -> Any:
        return self.probe_ipc()

    @property
    def accelerator(self) -> bool:
        return self.device != "cpu"

    @property
    def colocated(self) -> bool:
        return bool(self.where) and all(w == COLOCATED for w in self.where)

    @property
    def same_node(self) -> bool:
        return all(w != REMOTE for w in self.where)

    def describe(self, *kinds: str) -> str:
        """Which receivers are placed so, as people read them."""
        names = [r.name or f"rank {r.rank}" for r, w in zip(self.receivers, self.where) if w in kinds]
        shown = ", ".join(str(n) for n in names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        return f"{len(names)} receiver(s) ({shown})"


Rank = tuple[int, str]  # (rank: lower is taken first, the reason auto gives)


@dataclasses.dataclass(frozen=True)
class Transport:
    """A transport as the list of built-ins (or a plugin's ``register``) declares it.

    ``sender`` and ``receiver`` build its ends (the receiver from the sender's parsed session
    record); ``session`` and ``version`` parse its records' wire forms (a ProtocolError names
    the transport and the field); ``refuses`` says why an explicit choice of it cannot serve a
    placement, ``auto`` whether ``transport: auto`` should take it, with a rank and a reason.
    """

    name: str
    sender: Callable[[TransportContext], SenderTransport]
    receiver: Callable[[TransportContext, SessionRecord], ReceiverTransport]
    session: Callable[[Mapping[str, Any]], SessionRecord] = SessionRecord.from_wire
    version: Callable[[Mapping[str, Any]], VersionRecord] = VersionRecord.from_wire
    refuses: Callable[[Facts], str | None] = lambda facts: None
    auto: Callable[[Facts], Rank | None] = lambda facts: None
