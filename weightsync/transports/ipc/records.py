"""Internal. The ring's records: where a sender's ring of buffers is (its control block, each buffer's
host segment or device handle), published with the session and repeated with every version; the
ipc transport's, and shm's in its streaming mode (the ring over host segments), which names its
mode (records.py says how records cross the control plane)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from ...records import Record, SessionRecord, VersionRecord


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
    segment: str  # its segment reference (transports/shm/transport.py: Segment.ref)
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
    """shm in streaming mode: the ring over host segments (the whole-version mode's records are
    in shm/transport.py; ``mode`` tells them apart)."""

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
