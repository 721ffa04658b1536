"""Internal. The ring's two ends (ring.py): the IPC transport for colocated parties, sender and
receivers on the same physical device; and shm in streaming mode, the same ring over host segments.

The sender allocates two bucket-sized buffers on its device once per session (ping-pong, a
ring: ipc/ring.py, which shm's streaming mode owns one of too, with up to MAX_BUFFERS in host
memory) and shares them by handle; receivers open the handles once and load every bucket
straight out of the shared buffer, so a version never crosses host memory on an accelerator.
On CPU the buffers are host shared-memory segments (transports/shm/transport.py): the same protocol,
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

from collections.abc import Iterator
from typing import ClassVar

import torch

from ... import digest
from ...errors import ProtocolError
from ...manifest import Packer
from ...records import VersionRecord
from .. import Bucket, Deadline, ReceiverTransport, SenderTransport, TransportContext
from .records import IpcSession, IpcVersion, ShmStreamSession, ShmStreamVersion
from .ring import RingReader, RingWriter
from .wire import NBUF


class RingSender(SenderTransport):
    """A transport whose versions move through a ring of buffers at the barrier (ring.py): ipc,
    and shm when whole versions exceed its budget. A subclass names its records, the
    ``resource`` its segments and handles count as, and where the buffers live."""

    name: ClassVar[str]
    resource: ClassVar[str]
    session_type: ClassVar[type[IpcSession]]
    version_type: ClassVar[type[VersionRecord]]

    def __init__(self, ctx: TransportContext, nbuf: int, device: torch.device, why: str = ""):
        self.ctx = ctx
        kind = digest.kind_of(ctx.config, device)
        self.ring = RingWriter(ctx, self.name, self.resource, device, nbuf, kind)
        self.session = self.ring.session(self.session_type, why=why)

    def stage(self, version: int, slot: int, packer: Packer) -> VersionRecord:
        self.ring.stage(version, packer)  # written in send(), at the barrier
        # the whole rendezvous rides along with every version: a restarted trainer brings a
        # new control block and buffers, and receivers attached to the dead one's re-attach
        return self.version_type(session=self.session)

    def give_back(self, version: int) -> bool:
        packer = self.ring.take_back(version)
        if packer is not None:
            packer.drain()
        return packer is not None

    def send(self, version: int, deadline: Deadline) -> str | None:
        sums = self.ring.send(version, deadline)
        return digest.version_digest(self.session.digest_kind, sums) if sums is not None else None

    def close(self) -> None:
        self.ring.close()


class RingReceiver(ReceiverTransport):
    """A reading end of a RingSender's ring; ``loads_from_host``: its buffers may be in host
    memory whatever this receiver's device (shm's ring)."""

    name: ClassVar[str]
    resource: ClassVar[str]
    loads_from_host: ClassVar[bool] = False

    def __init__(self, ctx: TransportContext, session: IpcSession):
        self.ctx = ctx
        self.ring = RingReader(ctx, self.name, self.resource, session, loads_from_host=self.loads_from_host)

    def ring_session(self, version: int, record: VersionRecord) -> IpcSession:
        """The ring a version's record names (raises where the record is of another kind)."""
        return record.session

    def receive(self, version: int, record: VersionRecord, deadline: Deadline) -> Iterator[Bucket]:
        return self.ring.receive(version, self.ring_session(version, record), record.moves(self.ctx.plan), deadline)

    def close(self) -> None:
        self.ring.close()


class IpcSender(RingSender):
    name = "ipc"
    resource = "ipc"
    session_type = IpcSession
    version_type = IpcVersion

    def __init__(self, ctx: TransportContext, nbuf: int = NBUF):
        super().__init__(ctx, nbuf, ctx.device)


class IpcReceiver(RingReceiver):
    name = "ipc"
    resource = "ipc"


# -- shm in streaming mode: the ring over host segments ------------------------------------------


class ShmStreamSender(RingSender):
    """shm when whole versions exceed the node's budget (shm/transport.py: choose_mode): the writing
    end of a ring of K buffers in host shared memory, even on an accelerator node. It gives up
    what ipc gives up: nothing is kept (no rollback, a late joiner waits for the next version),
    and the tensors are read in ``sync()``."""

    name = "shm"
    resource = "shm_ring"
    session_type = ShmStreamSession
    version_type = ShmStreamVersion

    def __init__(self, ctx: TransportContext, buffers: int, why: str):
        super().__init__(ctx, buffers, torch.device("cpu"), why=why)


class ShmStreamReceiver(RingReceiver):
    """A reading end of the streaming shm ring, loading onto any device."""

    name = "shm"
    resource = "shm_ring"
    loads_from_host = True

    def ring_session(self, version: int, record: VersionRecord) -> ShmStreamSession:
        if not isinstance(record, ShmStreamVersion):
            # a restarted trainer that found room for whole versions: this session's receivers
            # were built for the ring
            raise ProtocolError(f"shm: version {version} is published in whole-version mode, but this receiver "
                                f"attached to a streaming session; restart the receiver")
        return record.session
