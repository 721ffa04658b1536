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
from typing import Any, ClassVar

import torch

from ...packing import Packing
from ..base import Received, ReceiverTransport, SenderTransport, TransportContext, VersionRecord
from .records import IpcSession, IpcVersion
from .ring import RingReader, RingWriter
from .wire import NBUF


class RingSender(SenderTransport):
    """A transport whose versions move through a ring of buffers at the barrier (ring.py): ipc,
    and shm when whole versions exceed its budget. A subclass names its records, the
    ``resource`` its segments and handles count as, and where the buffers live."""

    resource: ClassVar[str]

    def __init__(self, ctx: TransportContext, nbuf: int):
        super().__init__(ctx)
        self.ring = RingWriter(ctx, self.name, self.resource, self.buffer_device(), nbuf, self.digest_kind)

    def session_info(self) -> IpcSession:
        return self.ring.session(self.session_record)

    def stage(self, version: int, slot: int, packing: Packing,
              announce: Callable[[VersionRecord], None]) -> VersionRecord:
        self.ring.stage(version, packing)  # written in send(), at the barrier
        # the whole rendezvous rides along with every version: a restarted trainer brings a
        # new control block and buffers, and receivers attached to the dead one's re-attach
        return self.version_record(session=self.session_info())

    def send(self, version: int, deadline: float) -> None:
        sums = self.ring.send(version, deadline)
        if sums is not None:
            self._record(version, sums)

    def close(self) -> None:
        self.ring.close()


class RingReceiver(ReceiverTransport):
    """A reading end of a RingSender's ring; ``loads_from_host``: its buffers may be in host
    memory whatever this receiver's device (shm's ring)."""

    resource: ClassVar[str]
    loads_from_host: ClassVar[bool] = False

    def __init__(self, ctx: TransportContext, wire: Mapping[str, Any]):
        super().__init__(ctx, wire)
        self.ring = RingReader(ctx, self.name, self.resource, self.session, loads_from_host=self.loads_from_host)

    def ring_session(self, version: int, info: VersionRecord) -> IpcSession:
        """The ring a version's record names (raises where the record is of another kind)."""
        return info.session

    def receive(self, version: int, info: VersionRecord, deadline: float,
                check: Callable[[], None]) -> Iterator[Received]:
        buckets = self.ring.receive(version, self.ring_session(version, info), self.plan_of(info), deadline, check)
        self.digest_kind = self.ring.digest_kind  # a restarted sender's, where the ring followed one
        yield from buckets

    def buffers_generation(self) -> int:
        return self.ring.generation

    def close(self) -> None:
        self.ring.close()


class IpcSender(RingSender):
    name = "ipc"
    resource = "ipc"
    session_record = IpcSession
    version_record = IpcVersion

    def __init__(self, ctx: TransportContext, nbuf: int = NBUF):
        super().__init__(ctx, nbuf)

    def buffer_device(self) -> torch.device:
        return self.ctx.device


class IpcReceiver(RingReceiver):
    name = "ipc"
    resource = "ipc"
    session_record = IpcSession
    version_record = IpcVersion
