"""What a transport's sender publishes for its receivers, as typed records.

Two records per transport: its session record (published once with the session: the
rendezvous, the digest kind) and its version record (per version: where the bytes are, their
digests). The sender builds them; the coordinator stores and forwards their wire form
(``to_wire()``: plain msgpack-able data) without reading it; each receiver parses the wire
form back with ``from_wire()`` where it arrives. A field missing, unknown or of the wrong type
is a ProtocolError naming the transport and the field, so a sender and receivers of different
weightsync versions fail at the first record, not at a KeyError deep in a transfer.

A plugin transport brings its own records: subclasses of :class:`SessionRecord` and
:class:`VersionRecord` named by its sender and receiver classes (``session_record``,
``version_record``, see transports/base.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar, TypeVar

from ..coordinator import ops
from ..delta.codec import FULL, KINDS, SKIP
from ..delta.packing import wire_plan
from ..errors import ProtocolError
from ..plan import BucketPlan

DIGEST_KINDS = (None, "xxh3", "torch")
R = TypeVar("R", bound="Record")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Record:
    """A typed record with a strict wire form; subclasses name their ``transport``."""

    transport: ClassVar[str] = "transport"
    # keys that others than the sender add to the wire form and the record ignores (see
    # VersionRecord); never a field
    foreign: ClassVar[frozenset[str]] = frozenset()

    def to_wire(self) -> dict[str, Any]:
        """Plain data (dicts, lists, str, int, float, bool, bytes, None) for the control plane."""
        return ops.to_wire(self)

    @classmethod
    def from_wire(cls: type[R], wire: Any) -> R:
        """The record of ``wire`` (a ``to_wire()`` form that crossed the control plane).

        Raises:
            ProtocolError: a field is missing, unknown or of the wrong type; names the
                transport and the field.
        """
        return ops.from_wire(cls, wire, f"{cls.transport}: {cls.__name__}", cls.foreign)

    def _check(self, name: str, ok: bool, want: str) -> None:
        if not ok:
            raise ValueError(f"field {name!r} is {getattr(self, name)!r}, not {want}")


# -- the two kinds of record --------------------------------------------------------------------


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
        self._check("kinds", all(k in KINDS for k in self.kinds), " / ".join(KINDS) + " per bucket")
        self._check("kinds", self.base is not None or all(k == FULL for k in self.kinds), "full without a base")
        self._check("lengths", all(x == 0 for k, x in zip(self.kinds, self.lengths) if k == SKIP),
                    "0 for a skipped bucket")


@dataclasses.dataclass(frozen=True, kw_only=True)
class VersionRecord(Record):
    """Published per version (stage(): early through ``announce``, whole when staged); the
    coordinator merges the parts, so a field a later part brings has a default."""

    # the coordinator notes a broadcast version's group here for metrics (coordinator/membership_ops.py)
    foreign: ClassVar[frozenset[str]] = frozenset({"group"})
    digest: str | None = None  # of the whole version (digest.version_digest), once packed
    # a delta version's wire plan (the sender's delta: auto / on); None: the session plan
    delta: DeltaRecord | None = None

    def moves(self, plan: BucketPlan) -> BucketPlan:
        """The bucket lengths this version moves over the session ``plan``, bucket for bucket:
        the plan's own, or the encoded lengths its delta record names (delta/packing.py), so a
        transport sizes what it reads without knowing what the bytes mean."""
        return plan if self.delta is None else wire_plan(plan, self.delta.lengths)


# -- shm: whole versions in segments ------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShmSession(SessionRecord):
    transport: ClassVar[str] = "shm"
    mode: str = "whole"  # shm's two modes: "whole" here, "stream" in ShmStreamSession

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check("mode", self.mode == "whole", "'whole'")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShmVersion(VersionRecord):
    transport: ClassVar[str] = "shm"
    mode: str = "whole"
    segment: str  # the slot's segment reference (transports/memory.py)
    size: int  # its bytes
    checksums: list[int] = dataclasses.field(default_factory=list)  # per bucket, once staged
    packed_bytes: int = 0  # once staged

    def __post_init__(self) -> None:
        self._check("mode", self.mode == "whole", "'whole'")


# -- ipc: a ring of buffers shared by handle; shm streams through the same ---------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeviceRecord(Record):
    """Where a sender's buffers live (weightsync.device.describe)."""

    transport: ClassVar[str] = "ipc"
    type: str
    index: int | None = None
    physical: int | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class HostBuffer(Record):
    """A bucket buffer in host shared memory."""

    transport: ClassVar[str] = "ipc"
    kind: str = "host"
    segment: str  # its segment reference (transports/memory.py)
    bytes: int

    def __post_init__(self) -> None:
        self._check("kind", self.kind == "host", "'host'")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeviceHandle(Record):
    """A bucket buffer in device memory, shared by handle: the values of torch's (torch_npu's)
    reduce_tensor (ipc_wire.export_handle); ipc_wire.import_handle opens it."""

    transport: ClassVar[str] = "ipc"
    kind: str  # cuda / npu
    physical: int  # the sender's physical device id
    size: list[int]
    stride: list[int]
    offset: int
    typed: bool
    dtype: str
    handle: bytes
    storage_bytes: int
    storage_offset: int
    ref_handle: bytes | None
    ref_offset: int
    event: bytes | None
    event_sync: bool

    def __post_init__(self) -> None:
        self._check("kind", self.kind != "host", "a device type")


@dataclasses.dataclass(frozen=True, kw_only=True)
class IpcSession(SessionRecord):
    transport: ClassVar[str] = "ipc"
    control: str  # the control block's segment reference (transports/ipc/wire.py)
    buffers: list[HostBuffer | DeviceHandle]
    nbuf: int
    capacity: int  # bytes of each buffer
    device: DeviceRecord

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check("nbuf", self.nbuf == len(self.buffers) and self.nbuf >= 1, "the number of buffers (>= 1)")
        self._check("capacity", self.capacity >= 1, ">= 1")


@dataclasses.dataclass(frozen=True, kw_only=True)
class IpcVersion(VersionRecord):
    """The whole rendezvous rides along: receivers of a restarted sender follow its new buffers."""

    transport: ClassVar[str] = "ipc"
    session: IpcSession


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShmStreamSession(IpcSession):
    transport: ClassVar[str] = "shm"
    mode: str = "stream"

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check("mode", self.mode == "stream", "'stream'")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShmStreamVersion(VersionRecord):
    transport: ClassVar[str] = "shm"
    mode: str = "stream"
    session: ShmStreamSession

    def __post_init__(self) -> None:
        self._check("mode", self.mode == "stream", "'stream'")


def _shm_mode(wire: Any, what: str) -> str:
    mode = wire.get("mode") if isinstance(wire, Mapping) else None
    if mode not in ("whole", "stream"):
        raise ProtocolError(f"shm: {what} field 'mode' is {mode!r}, not 'whole' / 'stream'")
    return mode


def shm_session(wire: Any) -> ShmSession | ShmStreamSession:
    """The shm session record of either mode, by its ``mode`` field."""
    return (ShmStreamSession if _shm_mode(wire, "session") == "stream" else ShmSession).from_wire(wire)


def shm_version(wire: Any) -> ShmVersion | ShmStreamVersion:
    """The shm version record of either mode, by its ``mode`` field."""
    return (ShmStreamVersion if _shm_mode(wire, "version") == "stream" else ShmVersion).from_wire(wire)


# -- broadcast: a collective over a group built on the sender's store ---------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class BroadcastSession(SessionRecord):
    transport: ClassVar[str] = "broadcast"
    backend: str  # gloo / nccl / hccl
    communicator: str  # how the group is built (transports/broadcast/groups.py)
    communicator_reason: str
    host: str  # of the sender's TCPStore
    port: int
    store_id: str  # tells this sender's store from a restarted sender's
    # receive_ahead: the sender may send a version in stage(), before the barrier, to receivers
    # that keep a shadow of it (receive_ahead.py)
    ahead: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check("port", 0 < self.port < 65536, "a TCP port")


@dataclasses.dataclass(frozen=True, kw_only=True)
class BroadcastVersion(VersionRecord):
    """The store's address rides along: receivers of a restarted sender follow its new store."""

    transport: ClassVar[str] = "broadcast"
    session: BroadcastSession
    # sent in stage(), before the barrier, into every member's shadow: apply() loads from there
    ahead: bool = False
