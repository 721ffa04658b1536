"""IPC transport for colocated parties: sender and receivers on the same physical device.

The sender allocates two bucket-sized buffers on its device once per session (ping-pong;
shm's streaming mode, transports/shm/stream.py, uses up to MAX_BUFFERS in host memory)
and shares them by handle; receivers open the handles once and load every bucket straight
out of the shared buffer, so a version never crosses host memory on an accelerator. On
CPU the buffers are host shared-memory segments (transports/memory.py): the same protocol,
testable here, and the ring that shm streams through when whole versions exceed its budget.

Handles cross the process boundary as plain msgpack data and handshakes run through a small
host control segment, no coordinator round trip per bucket: both wire formats are laid
out in :mod:`weightsync.transports.ipc.wire`.
Bucket b of a version goes to buffer b % nbuf. Before overwriting a buffer the sender waits
until every receiver taking part in the version released the bucket it held; a receiver
the coordinator declared failed or dead is no longer waited for, and a receiver that is not
waited for (registered after the barrier, or declared failed) refuses the version before
loading anything, so it keeps the complete version it serves.
Every version's info repeats the rendezvous (control block and buffer handles): receivers
attached to a trainer that died follow its restarted successor's new buffers.

Unlike shm, data moves in ``send()`` (the barrier), not in ``stage()``: the buffers are
reused bucket by bucket, so the version's tensors are read during ``sync()`` and must stay
unchanged until it returns.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any, ClassVar

import numpy as np
import torch

from ... import device as devices
from ...coordinator.state import State
from ...digest import kind_of
from ...errors import CapacityError, DeadlineExceeded, ProtocolError, VersionError
from ...manifest import Packing, align_up
from ..base import (
    Aborted,
    DeviceHandle,
    DeviceRecord,
    HostBuffer,
    IpcSession,
    IpcVersion,
    Received,
    ReceiverTransport,
    SenderTransport,
    TransportContext,
    VersionRecord,
    poll_until,
)
from ..memory import PAGE, Segment, Waiter, attach, create, digest_word, reap_stale, wake
from .ring import Ring
from .wire import (
    BUCKET_BITS,
    CONTROL_BYTES,
    KIND_CODE,
    MAGIC,
    MAX_BUFFERS,
    MAX_RECEIVERS,
    NBUF,
    RELEASED,
    Watch,
    check_nd,
    export_handle,
    find_slot,
    import_handle,
    owner_word,
    ready_word,
    slot_word,
    tag,
)


class IpcSender(SenderTransport):
    name = "ipc"
    session_record = IpcSession
    version_record = IpcVersion
    # bucket buffers in host shared memory even on an accelerator (shm's streaming mode)
    host_buffers: ClassVar[bool] = False
    resource: ClassVar[str] = "ipc"  # status() counts our segments and handles as <resource>_*

    def __init__(self, ctx: TransportContext, nbuf: int = NBUF):
        super().__init__(ctx)
        self.directory = ctx.config.shm_dir
        reap_stale(self.directory)
        if not 1 <= nbuf <= MAX_BUFFERS:
            raise ValueError(f"{self.name}: {nbuf} buffers; the control block has room for 1 .. {MAX_BUFFERS}")
        self.nbuf = max(1, min(nbuf, ctx.plan.bucket_count))
        self.capacity = max([b.nbytes for b in ctx.plan.buckets] + [1])
        self.segments: list[Segment] = []
        self.buffers: list[torch.Tensor] = []
        self.handles: list[HostBuffer | DeviceHandle] = []
        self._pending: dict[int, Packing] = {}
        try:
            self.control = self._segment(CONTROL_BYTES, f"an {self.name} control block", f"{self.resource}_control")
            w = self.control.words
            w[0], w[1], w[2], w[3], w[4], w[5] = (MAGIC, digest_word(ctx.digest), self.nbuf, MAX_RECEIVERS,
                                                   os.getpid(), KIND_CODE[self.digest_kind])
            for _ in range(self.nbuf):
                self._allocate()
        except BaseException:
            self.close()
            raise

    def buffer_device(self) -> torch.device:
        return torch.device("cpu") if self.host_buffers else self.ctx.device

    def _segment(self, size: int, what: str, kind: str) -> Segment:
        seg = create(self.ctx.config, size, what, writable=True)
        self.segments.append(seg)
        self.ctx.account(kind, +1)
        return seg

    def _allocate(self) -> None:
        if self.buffer_device().type == "cpu":
            size = align_up(self.capacity, PAGE)
            seg = self._segment(size, f"a {self.name} bucket of {self.capacity} bytes", f"{self.resource}_handles")
            seg.pin(self.ctx.device)  # reused for every bucket of every version: page-locked once
            self.buffers.append(seg.bytes[: self.capacity])
            self.handles.append(HostBuffer(segment=seg.ref, bytes=self.capacity))
            return
        devices.set_current(self.ctx.device)
        t = torch.empty(self.capacity, dtype=torch.uint8, device=self.ctx.device)
        check_nd(t)
        self.handles.append(DeviceHandle.from_wire(export_handle(t)))
        self.buffers.append(t)
        self.ctx.account(f"{self.resource}_handles", +1)

    def session_info(self) -> IpcSession:
        return self.session_record(control=self.control.ref, buffers=list(self.handles), nbuf=self.nbuf,
                                   capacity=self.capacity, digest_kind=self.digest_kind,
                                   device=DeviceRecord(**devices.describe(self.buffer_device())))

    def stage(self, version: int, slot: int, packing: Packing,
              announce: Callable[[VersionRecord], None]) -> IpcVersion:
        if not 0 <= version < 1 << (63 - BUCKET_BITS) or self.ctx.plan.bucket_count >= 1 << BUCKET_BITS:
            raise VersionError(f"{self.name}: version {version} is out of range (0 .. 2**39)")
        # a newer version supersedes one staged but never sent
        self._pending = {version: packing}
        # the whole rendezvous rides along with every version: a restarted trainer brings a
        # new control block and buffers, and receivers attached to the dead one's re-attach
        return self.version_record(session=self.session_info())

    def send(self, version: int, deadline: float) -> None:
        packing = self._pending.pop(version, None)
        if packing is None:
            raise VersionError(f"{self.name}: version {version} was not staged on this transport (superseded?)")
        devices.set_current(self.ctx.device)
        try:
            ring = Ring(self, version, Watch(self.ctx, version), deadline, packing.plan)
            for b in packing.into(ring, self.digest_kind):
                ring.publish_through(b)
            ring.publish_through(packing.plan.bucket_count - 1)
            self._record(version, ring.sums)
        except Aborted:
            pass  # the coordinator has the reason; sync() reports it through wait_outcome

    def _wait_released(self, version: int, b: int, k: int, watch: Watch, deadline: float,
                       owed: Callable[[], None] | None = None) -> None:
        """Wait until every receiver released bucket ``b`` of ``version`` from buffer ``k``;
        ``owed`` runs first if it has to wait: what the receivers may be waiting for."""
        need, w = tag(version, b), self.control.words
        if not watch.pending(w, need, k):
            return
        if owed is not None:
            owed()
            if not watch.pending(w, need, k):
                return
        poll_until(
            lambda: not watch.pending(w, need, k), deadline, watch.refresh,
            lambda: DeadlineExceeded(
                f"{self.name}: receiver(s) {', '.join(watch.pending(w, need, k))} did not finish bucket {b} of version "
                f"{version} before the deadline (stalled in load_weights, or never called apply?)"),
            waiter=Waiter(w, RELEASED),  # receivers ring it after each release
        )

    def close(self) -> None:
        self._pending.clear()
        self.buffers.clear()  # device memory is freed once receivers dropped their mappings too
        if self.buffer_device().type != "cpu":
            for _ in self.handles:
                self.ctx.account(f"{self.resource}_handles", -1)
        self.handles.clear()
        for seg in self.segments:
            seg.close()
            self.ctx.account(f"{self.resource}_control" if seg is getattr(self, "control", None)
                             else f"{self.resource}_handles", -1)
        self.segments.clear()


class IpcReceiver(ReceiverTransport):
    name = "ipc"
    session_record = IpcSession
    version_record = IpcVersion
    host_buffers: ClassVar[bool] = False  # host buffers: the receiver may load onto any device
    resource: ClassVar[str] = "ipc"

    def __init__(self, ctx: TransportContext, wire: Mapping[str, Any]):
        super().__init__(ctx, wire)
        self.directory = ctx.config.shm_dir
        self.mappings: list[Segment] = []
        self.buffers: list[torch.Tensor] = []
        self.opened = 0  # device handles opened (host ones are counted as mappings)
        self.slot: int | None = None
        self.control: Segment | None = None
        self._attach(self.session)

    def _attach(self, info: IpcSession) -> None:
        """Open the sender's control block and buffers and take a receiver slot."""
        ctx = self.ctx
        sender_dev = info.device.type
        if sender_dev != ctx.device.type and not (self.host_buffers and sender_dev == "cpu"):
            raise ProtocolError(f"{self.name}: the sender's buckets are in {sender_dev} memory but receiver "
                                f"'{ctx.name}' runs on {ctx.device.type}; both must share one device")
        if not 1 <= info.nbuf <= MAX_BUFFERS:
            raise ProtocolError(f"{self.name}: session announces {info.nbuf} buffers")
        self.nbuf, self.capacity = info.nbuf, info.capacity
        self.kind = info.digest_kind if kind_of(ctx.config, ctx.device) is not None else None
        try:
            self.control = self._map(info.control, CONTROL_BYTES, writable=True, kind=f"{self.resource}_control")
            w = self.control.words
            if int(w[0]) != MAGIC or int(w[1]) != digest_word(ctx.digest):
                raise ProtocolError(f"ipc control block {self.control.name} belongs to another session layout")
            self._claim()
            devices.set_current(ctx.device)
            for h in info.buffers:
                if isinstance(h, HostBuffer):
                    seg = self._map(h.segment, h.bytes, writable=False, kind=f"{self.resource}_handles")
                    seg.pin(ctx.device)
                    self.buffers.append(seg.bytes[: self.capacity])
                else:
                    self.buffers.append(import_handle(h.to_wire()))
                    self.opened += 1
                    ctx.account(f"{self.resource}_handles", +1)
        except BaseException:
            self.close()
            raise

    def _follow(self, info: IpcSession) -> None:
        """A version from another control block than ours: the trainer was restarted and
        publishes new buffers. Drop the dead sender's mappings and attach to the new ones."""
        if self.control is not None and info.control == self.control.ref:
            return
        self.close()
        self._attach(info)

    def _map(self, name: str, size: int, writable: bool, kind: str) -> Segment:
        seg = attach(name, self.directory, size, writable=writable)
        self.mappings.append(seg)
        self.ctx.account(kind, +1)
        return seg

    def _claim(self) -> None:
        """Take a receiver slot in the control block (the same one again after a restart)."""
        me = owner_word(self.ctx.name)
        w = self.control.words
        fcntl.flock(self.control.fd, fcntl.LOCK_EX)  # receivers attach concurrently
        try:
            r = find_slot(w, me)
            if r is None:
                r = find_slot(w, 0)
                if r is None:
                    raise CapacityError(f"ipc: all {MAX_RECEIVERS} receiver slots of the session are taken")
            base = slot_word(r)
            w[base + 2: base + 2 + MAX_BUFFERS] = 0
            w[base + 1] = os.getpid()
            w[base] = me
            self.slot = r
        finally:
            fcntl.flock(self.control.fd, fcntl.LOCK_UN)

    def receive(self, version: int, info: IpcVersion, deadline: float,
                check: Callable[[], None]) -> Iterator[Received]:
        self._follow(info.session)
        self._check_member(version)
        w = self.control.words
        loaded = devices.Fences(self.ctx.device)  # the engine's copies out of each bucket
        held: list[int] = []  # buckets loaded from and not yet released
        for b, bucket in enumerate(self.plan_of(info).buckets):
            k = b % self.nbuf
            want = tag(version, b)
            word = ready_word(k)
            self._release(version, held, loaded, need=b - self.nbuf)  # the sender writes b there
            if int(w[word]) != want:
                # the sender may be waiting for a bucket we hold before it publishes b: hand
                # every one back (their loads land on their own) before waiting on the sender
                self._release(version, held, loaded, need=b - 1)
                self._wait(w, word, want, version, b, deadline, check)
            expected = int(w[word + 1]) if self.kind else None
            yield b, self.buffers[k][: bucket.nbytes], expected
            loaded.mark(b)
            held.append(b)
        self._release(version, held, loaded, need=self.ctx.plan.bucket_count - 1)

    def _release(self, version: int, held: list[int], loaded: devices.Fences, need: int) -> None:
        """Hand buckets back to the sender once the engine's copies out of them landed: those
        up to ``need`` waiting for that (the sender needs their buffers next), later ones only
        if they already did (on a device, an event per bucket instead of a synchronize)."""
        w, mine = self.control.words, slot_word(self.slot)
        while held and loaded.done(held[0], block=held[0] <= need):
            b = held.pop(0)
            k, want = b % self.nbuf, tag(version, b)
            if int(w[ready_word(k)]) != want:
                raise ProtocolError(f"{self.name}: bucket {b} of version {version} was overwritten while it was loaded "
                                    f"(the sender gave up waiting for receiver '{self.ctx.name}')")
            w[mine + 2 + k] = want
            # ring the sender's doorbell: any change of the word wakes it (memory.py), so racing
            # receivers need no atomic increment
            w[RELEASED] = int(w[RELEASED]) + 1
            wake(w, RELEASED)

    def _check_member(self, version: int) -> None:
        """Refuse a version whose sender does not wait for us, before touching the model: it
        may overwrite a bucket while we load it, and we would serve nothing instead of the
        complete version we hold. Participants are fixed when the sender reaches the barrier."""
        if self.ctx.control is None:
            return
        m = self.ctx.control.metrics(version)
        late = self.ctx.name not in m.participants or self.ctx.name in m.failed
        if m.state in (State.TRANSFERRING, State.COMMITTED) and late:
            raise VersionError(f"{self.name}: receiver '{self.ctx.name}' is not a participant of version {version}: it "
                               f"registered (or came back) after the sender reached the barrier, so the sender "
                               f"does not wait for it; it joins the next version")

    @staticmethod
    def _wait(w: np.ndarray, word: int, want: int, version: int, b: int, deadline: float,
              check: Callable[[], None]) -> None:
        def arrived() -> bool:
            got = int(w[word])
            if got > want:
                raise ProtocolError(f"ipc: the sender is past bucket {b} of version {version}; this receiver "
                                    f"joined the transfer late and catches up with the next version")
            return got == want

        poll_until(arrived, deadline, check,
                   lambda: DeadlineExceeded(f"ipc: bucket {b} of version {version} was not written "
                                            f"before the deadline"), waiter=Waiter(w, word))

    def close(self) -> None:
        if self.slot is not None and getattr(self, "control", None) is not None:
            w = self.control.words
            base = slot_word(self.slot)
            fcntl.flock(self.control.fd, fcntl.LOCK_EX)
            try:
                if int(w[base]) == owner_word(self.ctx.name):
                    w[base] = 0  # free the slot; the sender stops looking at it
            finally:
                fcntl.flock(self.control.fd, fcntl.LOCK_UN)
            self.slot = None
        self.buffers.clear()
        for _ in range(self.opened):
            self.ctx.account(f"{self.resource}_handles", -1)
        self.opened = 0
        for seg in self.mappings:
            seg.close()
            self.ctx.account(f"{self.resource}_control" if seg is getattr(self, "control", None)
                             else f"{self.resource}_handles", -1)
        self.mappings.clear()
        self.control = None
