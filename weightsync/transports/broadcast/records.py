"""Internal. The broadcast transport's records: the sender's store to build groups on, and per version
whether it was sent ahead, before the barrier."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from ...records import SessionRecord, VersionRecord


@dataclasses.dataclass(frozen=True, kw_only=True)
class BroadcastSession(SessionRecord):
    transport: ClassVar[str] = "broadcast"
    backend: str  # gloo / nccl / hccl
    communicator: str  # how the group is built (transports/broadcast/groups.py)
    communicator_reason: str
    host: str  # of the sender's TCPStore
    port: int
    store_id: str  # tells this sender's store from a restarted sender's
    # (ahead, from SessionRecord: with receive_ahead the sender may send a version in stage(),
    # before the barrier, to receivers that keep an ahead copy of it: broadcast/ahead.py)

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check("port", 0 < self.port < 65536, "a TCP port")


@dataclasses.dataclass(frozen=True, kw_only=True)
class BroadcastVersion(VersionRecord):
    """The store's address rides along: receivers of a restarted sender follow its new store."""

    transport: ClassVar[str] = "broadcast"
    session: BroadcastSession
    # sent in stage(), before the barrier, into every member's ahead copy: apply() loads from there
    ahead: bool = False
