"""Internal. The shm transport's records, in its two modes: whole versions in segments, and the
streaming ring (ipc's ring records with the mode named), told apart by their ``mode`` field."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

from ...errors import ProtocolError
from ...records import SessionRecord, VersionRecord
from ..ipc.records import IpcSession


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
