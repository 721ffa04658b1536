"""What a transport is, which there are, and which one a session uses. This package is the public
interface a plugin transport implements and registers; the modules under it are internal.

**The contract.** A transport moves one version's bucket bytes from the sender to its receivers,
and nothing else: planning, packing, checksums, unpacking, loading and the version protocol live
in the sender, the receiver and the coordinator, so one version takes the same path through the
code whatever the transport. A transport is two small classes:

- :class:`SenderTransport`: ``stage`` (pack the version: now, or keep the packer for the
  barrier), ``send`` (the barrier's part), ``close``;
- :class:`ReceiverTransport`: ``receive`` (the version's buckets, in plan order), ``close``.

What only some transports can do is a small Protocol that the sender or the receiver checks
once, with ``isinstance``: :class:`Announces` (receivers may read a version while it is being
staged), :class:`GivesBack` (a staged version can be given up unsent), :class:`Prefetches`
(verify a version ahead of the barrier), :class:`ReceivesAhead` (take whole versions before the
barrier), :class:`Replays` (a version stays readable: rollback, catch-up), :class:`Spans` (a
whole version lies in one buffer: split tensors need no reassembly).

A transport says what its receivers need in two typed records (records.py holds their bases): its
session record, published once (rendezvous, digest kind), and a version record per version (where
the bytes are). The coordinator stores and forwards their wire forms without reading them.

**Which there are.** A transport is a :class:`Transport` declaration: its name, how to build each
end, how to parse its records, and its rules for a placement. The built-in ones are one list
(``BUILTIN``), their rules the table below (docs/design.md, "How auto chooses"); a plugin brings
its own rules and calls :func:`register` in every party of a job (e.g. when it is imported).
``SyncConfig(transport=...)`` accepts exactly the names listed and "auto".

**The choice** (:func:`choose`): the sender's, when it stages its first version, from where every
party runs.

This module imports no torch (a config is checked where only the coordinator runs): each end, and
each record that needs torch, comes from a function that imports its module when a session picks it.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import importlib
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, runtime_checkable

from .. import config
from ..errors import ConfigError, DeadlineExceeded, ProtocolError, VersionError
from ..records import Message, SessionRecord, VersionRecord
from .broadcast.records import BroadcastSession, BroadcastVersion
from .ipc.records import IpcSession, IpcVersion, ShmStreamSession, ShmStreamVersion

if TYPE_CHECKING:
    import torch

    from ..config import SyncConfig
    from ..coordinator.client import ControlPlane, Member
    from ..manifest import BucketPlan, Manifest, Packer, RowPlan, RowWriter

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

    @functools.cached_property
    def row_plans(self) -> list[RowPlan]:
        """Where each trainer rank's rows go in the buckets of a sharded session (fixed by its
        plan: made once)."""
        from ..manifest import plan_rows

        return [plan_rows(self.plan, self.manifest, r) for r in range(self.manifest.senders)]

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


@runtime_checkable
class WritesRows(Protocol):
    """Every trainer rank writes its own rows of each version (a sharded session, the manifest's
    ``rows``): rank 0 opens the version (``Announces.announce``), every other rank joins what it
    announced, each writes its rows, and rank 0 merges the ranks' parts into the version's record."""

    def join(self, version: int, record: VersionRecord) -> None:
        """A rank other than 0: write into ``version`` where rank 0's record says it lies."""

    def write_rows(self, version: int, rows: RowWriter) -> Message:
        """This rank's rows of ``version``; its part of the version's record."""

    def merge(self, version: int, parts: list[Any]) -> VersionRecord:
        """Rank 0: the version's record from every rank's part (its own included, as written)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RowsSent(Message):
    """What one trainer rank of a sharded session sent of a version (SendsRows): the buckets it
    has rows in, the digest of each of its pieces, and the bytes."""

    rank: int
    buckets: list[int]
    sums: list[int]
    written: int


@runtime_checkable
class SendsRows(Protocol):
    """Every trainer rank sends its own rows of each version at the barrier (a sharded session
    of a transport that moves versions at the barrier: relay, broadcast). Rank 0's ``stage``
    takes its RowWriter where it takes a Packer, and its ``send`` sends those rows; every other
    rank sends its own with ``send_rows``."""

    def send_rows(self, version: int, rows: RowWriter, deadline: Deadline) -> RowsSent:
        """A rank other than 0: this rank's rows of ``version``, sent once rank 0 formed its group
        (at the barrier, or ahead: SendsRowsAhead); its part for the coordinator (what it sent)."""


@runtime_checkable
class SendsRowsAhead(Protocol):
    """A SendsRows transport whose rank 0 may send a version in ``stage()``, before the barrier
    (broadcast with receive_ahead): every other rank then sends its rows in its ``stage()`` too,
    with ``send_rows``, once rank 0's record of the version says so."""

    def went_ahead(self, record: VersionRecord) -> bool:
        """Whether rank 0's record of a version says it goes before the barrier."""


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
    # the end a trainer rank other than 0 writes its rows with, in a sharded session of this
    # transport (None: the transport's sessions are never sharded; versions are gathered)
    rows: Callable[[TransportContext, SessionRecord], SenderTransport] | None = None


# -- the built-in transports' rules --------------------------------------------------------------

_LATE = "auto: no receiver registered when the session was published (pass expected_receivers to let auto see placement)"


def _shm_refuses(f: Facts) -> str | None:
    if f.same_node:
        return None
    return (f"transport 'shm' needs every receiver on the sender's node ({f.node}); {f.describe(REMOTE)} on "
            f"{f.far} are not")


def _shm_auto(f: Facts) -> Rank | None:
    if not f.where:
        return None if f.accelerator else (1, f"{_LATE}; shm serves any receiver on this node")
    if f.colocated and not f.accelerator:
        # host memory both ways: ipc would copy as much as shm (measured slower with 1 and 4
        # receivers on CPU), and shm keeps the previous version for rollback and catch-up
        return 1, ("auto: every receiver is on the sender's node and the weights live in host memory; shm "
                   "(keeps the previous version for rollback and catch-up)")
    if f.colocated:
        if f.ipc.ok:
            return None
        return 1, f"auto: every receiver shares the sender's device, but ipc is unavailable ({f.ipc.reason}); fell back to shm"
    if not f.same_node:
        return None
    if f.accelerator and f.clash:
        return 1, f"auto: {f.describe(SAME_NODE)} on this node use other devices, but {f.clash}: no device collective; shm"
    if not f.accelerator:
        return 1, "auto: every receiver is on the sender's node and there is no device collective; shm"
    return None


def _ipc_refuses(f: Facts) -> str | None:
    if not f.ipc.ok:
        return f"transport 'ipc' cannot run here: {f.ipc.reason}"
    if f.colocated:
        return None
    if not f.where:
        return ("transport 'ipc' needs its receivers registered before the first stage "
                "(pass expected_receivers to the sender) to check they share its device")
    kind = REMOTE if REMOTE in f.where else SAME_NODE
    return (f"transport 'ipc' needs every receiver on the sender's device ({f.node}, {f.on_device}); "
            f"{f.describe(kind)} {'run on another node' if kind == REMOTE else 'use another device'}")


def _ipc_auto(f: Facts) -> Rank | None:
    if f.colocated and f.accelerator and f.ipc.ok:
        return 0, f"auto: every receiver shares the sender's device ({f.on_device}); {f.ipc.reason}"
    return None


def _broadcast_refuses(f: Facts) -> str | None:
    if not f.clash:
        return None
    return (f"transport 'broadcast' over the {f.device} collective needs one device per rank: {f.clash}; "
            f"use 'ipc' for parties on one device, or backend 'gloo'")


def _broadcast_auto(f: Facts) -> Rank | None:
    if not f.where:
        return (1, f"{_LATE}; broadcast works for any placement") if f.accelerator else None
    if f.same_node:
        if f.colocated or not f.accelerator or f.clash:
            return None
        return 1, f"auto: {f.describe(SAME_NODE)} on this node use other devices; broadcast over the {f.device} collective"
    if not f.accelerator:
        return None  # host memory across nodes: relay
    if f.clash:  # receivers on other nodes: nothing else reaches them
        raise ConfigError(f"auto: {f.describe(REMOTE)} on other nodes need broadcast, but {f.clash}; "
                          f"place each party of a node on its own device, or set backend 'gloo'")
    why = f"auto: {f.describe(REMOTE)} on other nodes ({f.far}); broadcast over the {f.device} collective, whose ring"
    if any(w != REMOTE for w in f.where):
        why += f" also reaches {f.describe(COLOCATED, SAME_NODE)} on the sender's node"
    return 1, why + " passes each bucket on from node to node"


def _relay_refuses(f: Facts) -> str | None:
    if f.accelerator:
        return (f"transport 'relay' moves host memory over gloo; the sender's weights are on {f.on_device} (use "
                f"'broadcast': its {f.device} collective relays on the device)")
    return None


def _relay_auto(f: Facts) -> Rank | None:
    if f.accelerator or f.same_node:
        return None
    why = (f"auto: {f.describe(REMOTE)} on other nodes ({f.far}); relay: one copy per receiving node, passed on "
           f"from node to node, read by the other receivers of a node from its shared memory")
    if any(w != REMOTE for w in f.where):
        why += f" ({f.describe(COLOCATED, SAME_NODE)} on the sender's node read the sender's)"
    return 1, why


# -- how each end is built: its module is imported when a session picks it -----------------------


def _shm_sender(ctx: TransportContext) -> SenderTransport:
    """Whole versions where they fit the node's budget (shm/transport.py), else the streaming ring
    (ipc/transport.py: the ring over host segments)."""
    from .shm.transport import ShmSender, choose_mode

    mode = choose_mode(ctx.plan, ctx.config, reserve=ctx.host_reserve)
    if mode.streaming:
        from .ipc.transport import ShmStreamSender

        return ShmStreamSender(ctx, mode.buffers, mode.reason)
    return ShmSender(ctx, mode.reason)


def _shm_rows(ctx: TransportContext, session: SessionRecord) -> SenderTransport:
    """A rank's writer of rows into rank 0's segments: whole versions only (a streaming ring
    passes each bucket from one writer)."""
    from .shm.transport import ShmSender, ShmSession

    if not isinstance(session, ShmSession):
        raise ProtocolError("shm: the session streams through a ring; its versions are not written by every rank")
    writer = ShmSender(ctx)
    writer.session = session  # digests of the kind rank 0 published, whatever this rank's device
    return writer


def _shm_receiver(ctx: TransportContext, session: SessionRecord) -> ReceiverTransport:
    """The receiver of the mode the sender published."""
    if isinstance(session, ShmStreamSession):
        from .ipc.transport import ShmStreamReceiver

        return ShmStreamReceiver(ctx, session)
    from .shm.transport import ShmReceiver

    return ShmReceiver(ctx, session)


def _shm_mode(wire: Any, what: str) -> str:
    mode = wire.get("mode") if isinstance(wire, Mapping) else None
    if mode not in ("whole", "stream"):
        raise ProtocolError(f"shm: {what} field 'mode' is {mode!r}, not 'whole' / 'stream'")
    return mode


def shm_session(wire: Any) -> SessionRecord:
    """The shm session record of either mode, by its ``mode`` field."""
    if _shm_mode(wire, "session") == "stream":
        return ShmStreamSession.from_wire(wire)
    from .shm.transport import ShmSession

    return ShmSession.from_wire(wire)


def shm_version(wire: Any) -> VersionRecord:
    """The shm version record of either mode, by its ``mode`` field."""
    if _shm_mode(wire, "version") == "stream":
        return ShmStreamVersion.from_wire(wire)
    from .shm.transport import ShmVersion

    return ShmVersion.from_wire(wire)


def _ipc_sender(ctx: TransportContext) -> SenderTransport:
    from .ipc.transport import IpcSender

    return IpcSender(ctx)


def _ipc_receiver(ctx: TransportContext, session: SessionRecord) -> ReceiverTransport:
    from .ipc.transport import IpcReceiver

    return IpcReceiver(ctx, session)


def _broadcast_sender(ctx: TransportContext) -> SenderTransport:
    from .broadcast.transport import BroadcastSender

    return BroadcastSender(ctx)


def _broadcast_rows(ctx: TransportContext, session: SessionRecord) -> SenderTransport:
    """A rank's sender of its rows, on rank 0's store."""
    from .broadcast.transport import BroadcastSender

    return BroadcastSender(ctx, session)


def _broadcast_receiver(ctx: TransportContext, session: SessionRecord) -> ReceiverTransport:
    from .broadcast.transport import BroadcastReceiver

    return BroadcastReceiver(ctx, session)


def _relay_sender(ctx: TransportContext) -> SenderTransport:
    from .relay.transport import RelaySender

    return RelaySender(ctx)


def _relay_rows(ctx: TransportContext, session: SessionRecord) -> SenderTransport:
    """A rank's sender of its rows, on rank 0's store."""
    from .relay.transport import RelaySender

    return RelaySender(ctx, session)


def _relay_receiver(ctx: TransportContext, session: SessionRecord) -> ReceiverTransport:
    from .relay.transport import RelayReceiver

    return RelayReceiver(ctx, session)


def relay_session(wire: Any) -> SessionRecord:
    from .relay.transport import RelaySession

    return RelaySession.from_wire(wire)


def relay_version(wire: Any) -> VersionRecord:
    from .relay.transport import RelayVersion

    return RelayVersion.from_wire(wire)


BUILTIN = (
    Transport("broadcast", _broadcast_sender, _broadcast_receiver, BroadcastSession.from_wire,
              BroadcastVersion.from_wire, _broadcast_refuses, _broadcast_auto, _broadcast_rows),
    Transport("ipc", _ipc_sender, _ipc_receiver, IpcSession.from_wire, IpcVersion.from_wire, _ipc_refuses, _ipc_auto),
    # across nodes in host memory: one copy per node, passed on from node to node
    Transport("relay", _relay_sender, _relay_receiver, relay_session, relay_version, _relay_refuses, _relay_auto,
              _relay_rows),
    # whole versions in segments, or a streaming ring when they exceed the budget: the records say which
    Transport("shm", _shm_sender, _shm_receiver, shm_session, shm_version, _shm_refuses, _shm_auto, _shm_rows),
)

_known: dict[str, Transport] = {t.name: t for t in BUILTIN}
_lock = threading.Lock()


def register(transport: Transport) -> None:
    """Make a transport declared outside this package selectable (every party of a job must).

    Raises:
        ValueError: its name is "auto" or taken.
    """
    with _lock:
        if transport.name == "auto" or transport.name in _known:
            raise ValueError(f"transport {transport.name!r} is already registered")
        _known[transport.name] = transport
        config.TRANSPORTS.append(transport.name)  # a config may name it now


def forget(name: str) -> None:
    """Undo :func:`register` (the built-in transports stay)."""
    with _lock:
        if name not in {t.name for t in BUILTIN} and _known.pop(name, None) is not None:
            config.TRANSPORTS.remove(name)


def names() -> list[str]:
    """Every transport's name, sorted ("auto" is not one)."""
    return sorted(_known)


def get(name: str) -> Transport:
    """The transport ``name``.

    Raises:
        ValueError: none of that name.
    """
    known = _known.get(name)
    if known is None:
        raise ValueError(f"no transport named {name!r}; registered: {', '.join(names())}")
    return known


# -- the choice ---------------------------------------------------------------------------------


def _is_accelerator(kind: str) -> bool:
    """Whether ``kind`` is a device with memory of its own (not the host)."""
    return kind != "cpu"


def node_key(party: Any) -> str | None:
    """What identifies a party's node: its Ray node id, else (no Ray) its host address."""
    return party.node_id or party.host


def on_one_node(a: Any, b: Any) -> bool:
    """Two parties share a node (its /dev/shm, its devices) when their Ray node ids are equal;
    the host address decides only where a party has no node id (no Ray): several raylets on one
    machine, or nodes behind one address, are distinct nodes."""
    if a.node_id and b.node_id:
        return a.node_id == b.node_id
    return a.host == b.host


def node_label(party: Any) -> str:
    """A node as people read it: address and short Ray node id (simulated nodes share an address)."""
    node = party.node_id
    return f"{party.host} (node {node[:8]})" if node else str(party.host)


def _device(party: Any) -> Any:
    return party.device if party.device is not None else _HOST


@dataclasses.dataclass(frozen=True)
class _Host:
    type: str = "cpu"
    index: int | None = None
    physical: int | None = None


_HOST = _Host()


def placement(sender: Any, receiver: Any) -> str:
    """Where ``receiver`` runs relative to ``sender``: COLOCATED, SAME_NODE or REMOTE."""
    if not on_one_node(sender, receiver):
        return REMOTE
    sd, rd = _device(sender), _device(receiver)
    if sd.type != rd.type:
        return SAME_NODE
    if not _is_accelerator(sd.type):
        return COLOCATED  # host memory: one node is one "device"
    return COLOCATED if sd.physical is not None and sd.physical == rd.physical else SAME_NODE


def shared_device(sender: Any, receivers: Sequence[Any]) -> str | None:
    """Two parties on one physical accelerator, or None. A device collective (NCCL, HCCL)
    cannot hold one device twice: NCCL stops with "Duplicate GPU detected" or hangs."""
    seen: dict[tuple, str] = {}
    for who, party in [("the sender", sender)] + [(f"receiver '{r.name or r.rank}'", r) for r in receivers]:
        dev = _device(party)
        if not _is_accelerator(dev.type) or dev.physical is None:
            continue
        key = (node_key(party), dev.type, dev.physical)
        if key in seen:
            return f"{seen[key]} and {who} share physical {dev.type} {dev.physical} on {node_label(party)}"
        seen[key] = who
    return None


def facts(sender: Any, receivers: Sequence[Any], backend: str = "auto", shm_dir: str = "/dev/shm") -> Facts:
    """Where the parties are (``records.Placement`` each), as the rules read them. The sender's
    ipc support is its placement's where given, else probed on first use (ipc/support.py)."""
    where = [placement(sender, r) for r in receivers]
    dev = _device(sender)

    def probe_ipc() -> Any:
        if sender.ipc is not None:
            return sender.ipc
        from .ipc.support import ipc_support

        return ipc_support(dev.type, shm_dir)

    far = ", ".join(sorted({node_label(r) for r, w in zip(receivers, where) if w == REMOTE}))
    return Facts(sender=sender, receivers=receivers, where=where, device=dev.type,
                 on_device=f"physical {dev.type} {dev.physical}" if _is_accelerator(dev.type) else "host",
                 node=node_label(sender), far=far,
                 clash=shared_device(sender, receivers) if backend != "gloo" else None, probe_ipc=probe_ipc)


def choose(requested: str, sender: Any, receivers: Sequence[Any], backend: str = "auto",
           shm_dir: str = "/dev/shm") -> tuple[str, str]:
    """(transport, reason) for a session. An explicit choice that cannot work raises ConfigError
    with the reason its rules give; ``auto`` takes the transport whose rule ranks first for this
    placement and says why. ``backend`` is the broadcast backend of the config (gloo may share a
    device)."""
    f = facts(sender, receivers, backend, shm_dir)
    if requested != "auto":
        why = get(requested).refuses(f)
        if why:
            raise ConfigError(why)
        return requested, f"transport '{requested}' requested by config"
    ranked = sorted((r[0], t.name, r[1]) for t in list(_known.values()) if (r := t.auto(f)) is not None)
    if not ranked:
        raise ConfigError(f"auto: no transport serves this placement ({', '.join(f.where) or 'no receivers'})")
    return ranked[0][1], ranked[0][2]


# -- deprecated: the string-wired registration of earlier releases ------------------------------


def register_transport(name: str, module: str, sender: str, receiver: str, **rules: Any) -> None:
    """Deprecated (one release): ``register(Transport(...))`` with the ends themselves. ``module``,
    a module the caller names, defines the ``sender`` and ``receiver`` classes (a receiver taking
    the session record's wire form, as before)."""
    warnings.warn("weightsync.transports.register_transport is deprecated; use "
                  "register(Transport(name, sender, receiver, ...))", DeprecationWarning, stacklevel=2)

    def build_sender(ctx: TransportContext) -> SenderTransport:
        return getattr(importlib.import_module(module), sender)(ctx)

    def build_receiver(ctx: TransportContext, session: SessionRecord) -> ReceiverTransport:
        return getattr(importlib.import_module(module), receiver)(ctx, session)

    register(Transport(name, build_sender, build_receiver, **rules))


def sender_class(name: str) -> Callable[[TransportContext], SenderTransport]:
    """Deprecated (one release): ``get(name).sender``."""
    warnings.warn("weightsync.transports.sender_class is deprecated; use get(name).sender", DeprecationWarning,
                  stacklevel=2)
    return get(name).sender


def receiver_class(name: str) -> Callable[[TransportContext, Mapping[str, Any]], ReceiverTransport]:
    """Deprecated (one release): ``get(name).receiver``, which takes the parsed session record."""
    warnings.warn("weightsync.transports.receiver_class is deprecated; use get(name).receiver", DeprecationWarning,
                  stacklevel=2)
    t = get(name)
    return lambda ctx, wire: t.receiver(ctx, t.session(wire))


__all__ = ["BUILTIN", "Facts", "Rank", "ReceiverTransport", "SenderTransport", "SessionRecord", "Transport",
           "TransportContext", "VersionRecord", "choose", "get", "names", "register", "receiver_class",
           "register_transport", "sender_class"]
