"""Internal. IPC transport for colocated parties: sender and receivers on the same physical device.

The sender allocates two bucket-sized buffers on its device once per session (ping-pong, a
ring: ipc/ring.py, which shm's streaming mode owns one of too, with up to MAX_BUFFERS in host
memory) and shares them by handle; receivers open the handles once and load every bucket
straight out of the shared buffer, so a version never crosses host memory on an accelerator.
On CPU the buffers are host shared-memory segments (transports/memory.py): the same protocol,
testable here.

Handles cross the process boundary as plain msgpack data and handshakes run through a small
host control segment, no coordinator round trip per bucket: both wire formats are laid
out in :mod:`weightsync.transports.ipc.wire`; the ring's protocol (who waits for whom, what a
late or failed receiver does) in :mod:`weightsync.transports.ipc.ring`.

Unlike shm, data moves in ``send()`` (the barrier), not in ``stage()``: the buffers are
reused bucket by bucket, so the version's tensors are read during ``sync()`` and must stay
unchanged until it returns.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from ...manifest import Packing
from ..base import IpcSession, IpcVersion, Received, ReceiverTransport, SenderTransport, TransportContext, VersionRecord
from .ring import RingReader, RingWriter
from .wire import NBUF


class IpcSender(SenderTransport):
    name = "ipc"
    session_record = IpcSession
    version_record = IpcVersion

    def __init__(self, ctx: TransportContext, nbuf: int = NBUF):
        super().__init__(ctx)
        self.ring = RingWriter(ctx, self.name, "ipc", self.buffer_device(), nbuf, self.digest_kind)

    def buffer_device(self) -> torch.device:
        return self.ctx.device

    def session_info(self) -> IpcSession:
        return self.ring.session(IpcSession)

    def stage(self, version: int, slot: int, packing: Packing,
              announce: Callable[[VersionRecord], None]) -> IpcVersion:
        self.ring.stage(version, packing)
        # the whole rendezvous rides along with every version: a restarted trainer brings a
        # new control block and buffers, and receivers attached to the dead one's re-attach
        return IpcVersion(session=self.session_info())

    def send(self, version: int, deadline: float) -> None:
        sums = self.ring.send(version, deadline)
        if sums is not None:
            self._record(version, sums)

    def close(self) -> None:
        self.ring.close()


class IpcReceiver(ReceiverTransport):
    name = "ipc"
    session_record = IpcSession
    version_record = IpcVersion

    def __init__(self, ctx: TransportContext, wire: Mapping[str, Any]):
        super().__init__(ctx, wire)
        self.ring = RingReader(ctx, self.name, "ipc", self.session)

    def receive(self, version: int, info: IpcVersion, deadline: float,
                check: Callable[[], None]) -> Iterator[Received]:
        buckets = self.ring.receive(version, info.session, self.plan_of(info), deadline, check)
        self.kind = self.ring.kind  # a restarted sender's, where the ring followed one
        yield from buckets

    def buffers_generation(self) -> int:
        return self.ring.generation

    def close(self) -> None:
        self.ring.close()
