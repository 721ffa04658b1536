"""Internal. A ring of K bucket buffers and its control block, both ends, which ipc and shm's
streaming mode move versions through (transport.py: RingSender, RingReceiver). An end knows its
transport only by the ``owner`` its errors start with and the ``resource`` it counts in status():

  RingWriter   .session(record), .stage(version, packer), .send(version, deadline) -> digests
  RingReader   .digest_kind, .receive(version, session, plan, deadline) -> buckets in order

Control words and handles on the wire: ipc/wire.py. Bucket b of a version goes to buffer b % nbuf.
Before overwriting a buffer the writer waits until every receiver taking part in the version
released the bucket it held; one the coordinator declared failed or dead is no longer waited for,
and a receiver that is not waited for (registered after the barrier, or declared failed) refuses
the version before loading anything, so it keeps the complete version it serves. Every version's
record repeats the rendezvous: readers attached to a dead trainer follow its successor's new ring.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import numpy as np
import torch

from ... import device as devices
from ...digest import as_int, compute, kind_of
from ...errors import CapacityError, DeadlineExceeded, ProtocolError, VersionError
from ...manifest import BucketPlan, Packer, PackViews, align_up
from .. import Aborted, Bucket, Deadline, TransportContext
from ..shm.transport import PAGE, Segment, Waiter, attach, create, digest_word, poll_until, reap_stale, wake
from .records import DeviceHandle, DeviceRecord, HostBuffer, IpcSession
from .wire import (
    BUCKET_BITS,
    CONTROL_BYTES,
    KIND_CODE,
    MAGIC,
    MAX_BUFFERS,
    MAX_RECEIVERS,
    RELEASED,
    Watch,
    check_nd,
    export_handle,
    find_slot,
    import_handle,
    must_wait_for_me,
    owner_word,
    ready_word,
    slot_word,
    tag,
)

S = TypeVar("S", bound=IpcSession)


class RingWriter:
    """The sender's end: a control block and ``nbuf`` bucket buffers on ``device`` (host
    shared-memory segments on CPU, device memory shared by handle elsewhere), allocated once."""

    def __init__(self, ctx: TransportContext, owner: str, resource: str, device: torch.device, nbuf: int,
                 digest_kind: str | None):
        self.ctx, self.owner, self.resource, self.device, self.digest_kind = ctx, owner, resource, device, digest_kind
        reap_stale(ctx.config.shm_dir)
        if not 1 <= nbuf <= MAX_BUFFERS:
            raise ValueError(f"{owner}: {nbuf} buffers; the control block has room for 1 .. {MAX_BUFFERS}")
        self.nbuf = max(1, min(nbuf, ctx.plan.bucket_count))
        self.capacity = max([b.nbytes for b in ctx.plan.buckets] + [1])
        self.segments: list[Segment] = []
        self.buffers: list[torch.Tensor] = []
        self.handles: list[HostBuffer | DeviceHandle] = []
        self.control: Segment | None = None
        self._pending: dict[int, Packer] = {}
        self.views = PackViews()  # where each bucket's tensors go in each buffer, made once
        try:
            self.control = self._segment(CONTROL_BYTES, f"an {owner} control block", f"{resource}_control")
            w = self.control.words
            w[0], w[1], w[2], w[3], w[4], w[5] = (MAGIC, digest_word(ctx.digest), self.nbuf, MAX_RECEIVERS,
                                                   os.getpid(), KIND_CODE[digest_kind])
            for _ in range(self.nbuf):
                self._allocate()
        except BaseException:
            self.close()
            raise

    def _segment(self, size: int, what: str, kind: str) -> Segment:
        seg = create(self.ctx.config, size, what, writable=True)
        self.segments.append(seg)
        self.ctx.account(kind, +1)
        return seg

    def _allocate(self) -> None:
        if self.device.type == "cpu":
            size = align_up(self.capacity, PAGE)
            seg = self._segment(size, f"a {self.owner} bucket of {self.capacity} bytes", f"{self.resource}_handles")
            seg.pin(self.ctx.device)  # reused for every bucket of every version: page-locked once
            self.buffers.append(seg.bytes[: self.capacity])
            self.handles.append(HostBuffer(segment=seg.ref, bytes=self.capacity))
            return
        devices.set_current(self.ctx.device)
        t = torch.empty(self.capacity, dtype=torch.uint8, device=self.ctx.device)
        check_nd(t)
        self.handles.append(export_handle(t))
        self.buffers.append(t)
        self.ctx.account(f"{self.resource}_handles", +1)

    def session(self, record: type[S], why: str = "") -> S:
        return record(control=self.control.ref, buffers=list(self.handles), nbuf=self.nbuf, capacity=self.capacity,
                      digest_kind=self.digest_kind, device=DeviceRecord(**devices.describe(self.device)), why=why)

    def stage(self, version: int, packer: Packer) -> None:
        """Keep ``packer`` for send(): the ring is written at the barrier, bucket by bucket."""
        if not 0 <= version < 1 << (63 - BUCKET_BITS) or self.ctx.plan.bucket_count >= 1 << BUCKET_BITS:
            raise VersionError(f"{self.owner}: version {version} is out of range (0 .. 2**39)")
        self._pending = {version: packer}  # a newer version supersedes one staged but never sent

    def take_back(self, version: int) -> Packer | None:
        """The packer kept for ``version``, which will not be sent now (given back)."""
        return self._pending.pop(version, None)

    def send(self, version: int, deadline: Deadline) -> list[int] | None:
        """Pack the staged ``version`` through the ring: its bucket digests, or None where the
        coordinator aborted it (it has the reason; sync() reports it through wait_outcome)."""
        packer = self._pending.pop(version, None)
        if packer is None:
            raise VersionError(f"{self.owner}: version {version} was not staged on this transport (superseded?)")
        devices.set_current(self.ctx.device)
        try:
            watch = Watch(self.ctx, version)
            watch.write_roster(self.control.words)
            run = _Run(self, version, watch, deadline, packer.plan)
            for b in range(packer.plan.bucket_count):
                digest = packer.fill(b, run.claim(b), self.digest_kind, self.views)
                run.done(b, digest)
                run.publish_through(b - 1)  # b's copies are queued: waiting for b - 1 keeps the device busy
            run.publish_through(packer.plan.bucket_count - 1)
            return run.sums
        except Aborted:
            packer.drain()  # the iteration may be a collective the other trainer ranks are in
            return None

    def wait_released(self, version: int, b: int, k: int, watch: Watch, deadline: Deadline,
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
        try:
            poll_until(lambda: not watch.pending(w, need, k), deadline, "", Waiter(w, RELEASED),  # rung after each release
                       tick=watch.refresh)
        except DeadlineExceeded:
            raise DeadlineExceeded(
                f"{self.owner}: receiver(s) {', '.join(watch.pending(w, need, k))} did not finish bucket {b} of "
                f"version {version} before the deadline (stalled in load_weights, or never called apply?)") from None

    def close(self) -> None:
        self._pending.clear()
        self.views.clear()
        self.buffers.clear()  # device memory is freed once receivers dropped their mappings too
        if self.device.type != "cpu":
            for _ in self.handles:
                self.ctx.account(f"{self.resource}_handles", -1)
        self.handles.clear()
        for seg in self.segments:
            seg.close()
            self.ctx.account(f"{self.resource}_control" if seg is self.control else f"{self.resource}_handles", -1)
        self.segments.clear()


class _Run:
    """One version packed into the writer's ring: bucket b goes to buffer b % nbuf once every
    receiver released the bucket it held there (``claim``); a bucket is published (digest, then
    ready word) once its copies have landed. On a device an event per bucket says so (Fences):
    the host queues bucket b's copies while b - 1's are still in flight, and blocks on one only
    when its buffer is needed again."""

    def __init__(self, ring: RingWriter, version: int, watch: Watch, deadline: Deadline, plan: BucketPlan):
        self.plan = plan  # the packer's wire lengths (shorter where its buckets are encoded)
        self.ring, self.version, self.watch, self.deadline = ring, version, watch, deadline
        self.published = self.fenced = -1
        self.asked: set[int] = set()
        self.digests: dict[int, Any] = {}  # from the packer, by bucket, until published
        self.sums: list[int] = []
        self.fences = devices.Fences(ring.device)

    def claim(self, b: int) -> torch.Tensor:
        """Bucket b's buffer, once free; every bucket before b is full by then."""
        r = self.ring
        self.publish_through(b - 1, block=False)
        self.asked.add(b)
        k = b % r.nbuf
        if b >= r.nbuf:
            self.publish_through(b - r.nbuf)  # receivers release only what they saw published
            # a receiver may be waiting for bucket b - 1 before it releases anything (its own
            # loads land late too): publish every full bucket before waiting on the receivers
            r.wait_released(self.version, b - r.nbuf, k, self.watch, self.deadline,
                            owed=lambda: self.publish_through(b - 1))
        r.control.words[ready_word(k)] = 0  # receivers that outlived their turn see the overwrite
        return r.buffers[k][: self.plan.buckets[b].nbytes]

    def done(self, b: int, digest: int | torch.Tensor | None) -> None:
        if digest is not None:
            self.digests[b] = digest
        self._fence(b)  # the event right behind b's copies and digest: b is published once they land

    def _fence(self, last: int) -> None:
        """Buckets up to ``last`` are fully queued: mark them, their device digests copied behind."""
        if last <= self.fenced:
            return
        while self.fenced < last:
            b = self.fenced + 1
            if b not in self.asked:
                self.fences.mark(b - 1)  # claiming may wait on an earlier bucket: it must be marked
                self.claim(b)  # never handed out (nothing to write): still claim the buffer
            d = self.digests.get(b)
            if isinstance(d, torch.Tensor):
                self.digests[b] = self.fences.host_copy(d)
            self.fenced = b
        self.fences.mark(last)

    def publish_through(self, last: int, block: bool = True) -> None:
        """Publish buckets up to ``last``; without ``block``, only those already landed."""
        if last <= self.published:
            return
        self._fence(last)
        r, w = self.ring, self.ring.control.words
        while self.published < last:
            b = self.published + 1
            if not self.fences.done(b, block):
                return
            k, n = b % r.nbuf, self.plan.buckets[b].nbytes
            if r.digest_kind:
                d = self.digests.pop(b, None)
                self.sums.append(as_int(compute(r.digest_kind, r.buffers[k][:n]) if d is None else d))
                w[ready_word(k) + 1] = self.sums[-1]
            w[ready_word(k)] = tag(self.version, b)
            wake(w, ready_word(k))  # receivers sleeping on the word (shm/transport.py: Waiter)
            self.published = b


class RingReader:
    """A receiver's end: maps the writer's control block and buffers, takes a receiver slot,
    and reads each version bucket by bucket. ``loads_from_host``: buffers in host memory may be
    loaded onto any device (shm); otherwise the writer's device type must be this receiver's."""

    def __init__(self, ctx: TransportContext, owner: str, resource: str, session: IpcSession,
                 loads_from_host: bool = False):
        self.ctx, self.owner, self.resource, self.loads_from_host = ctx, owner, resource, loads_from_host
        self.mappings: list[Segment] = []
        self.buffers: list[torch.Tensor] = []
        self.opened = 0  # device handles opened (host ones are counted as mappings)
        self.slot: int | None = None
        self.control: Segment | None = None
        self.digest_kind: str | None = None
        self.generation = 0  # bumped whenever the buffers go (Bucket.generation)
        self._attach(session)

    def _attach(self, info: IpcSession) -> None:
        """Open the writer's control block and buffers and take a receiver slot."""
        ctx = self.ctx
        sender_dev = info.device.type
        if sender_dev != ctx.device.type and not (self.loads_from_host and sender_dev == "cpu"):
            raise ProtocolError(f"{self.owner}: the sender's buckets are in {sender_dev} memory but receiver "
                                f"'{ctx.name}' runs on {ctx.device.type}; both must share one device")
        if not 1 <= info.nbuf <= MAX_BUFFERS:
            raise ProtocolError(f"{self.owner}: session announces {info.nbuf} buffers")
        self.nbuf, self.capacity = info.nbuf, info.capacity
        self.digest_kind = info.digest_kind if kind_of(ctx.config, ctx.device) is not None else None
        try:
            self.control = self._map(info.control, CONTROL_BYTES, writable=True, kind=f"{self.resource}_control")
            w = self.control.words
            if int(w[0]) != MAGIC or int(w[1]) != digest_word(ctx.digest):
                raise ProtocolError(f"{self.owner} control block {self.control.name} belongs to another session layout")
            self._claim()
            devices.set_current(ctx.device)
            for h in info.buffers:
                if isinstance(h, HostBuffer):
                    seg = self._map(h.segment, h.bytes, writable=False, kind=f"{self.resource}_handles")
                    seg.pin(ctx.device)
                    self.buffers.append(seg.bytes[: self.capacity])
                else:
                    self.buffers.append(import_handle(h))
                    self.opened += 1
                    ctx.account(f"{self.resource}_handles", +1)
        except BaseException:
            self.close()
            raise

    def _map(self, name: str, size: int, writable: bool, kind: str) -> Segment:
        seg = attach(name, self.ctx.config.shm_dir, size, writable=writable)
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
                    raise CapacityError(f"{self.owner}: all {MAX_RECEIVERS} receiver slots of the session are taken")
            base = slot_word(r)
            w[base + 2: base + 2 + MAX_BUFFERS] = 0
            w[base + 1] = os.getpid()
            w[base] = me
            self.slot = r
        finally:
            fcntl.flock(self.control.fd, fcntl.LOCK_UN)

    def receive(self, version: int, session: IpcSession, plan: BucketPlan, deadline: Deadline) -> Iterator[Bucket]:
        """The buckets of ``version`` (``plan``: the lengths it moves), from the ring its record's
        ``session`` names: a version from another control block than ours comes from a restarted
        trainer, whose new ring this end follows (dropping the dead one's mappings) now, before
        the first bucket is asked for: ``kind`` is then that sender's."""
        if self.control is None or session.control != self.control.ref:
            self.close()
            self._attach(session)
        return self._read(version, plan, deadline)

    def _read(self, version: int, plan: BucketPlan, deadline: Deadline) -> Iterator[Bucket]:
        w = self.control.words
        loaded = devices.Fences(self.ctx.device)  # the engine's copies out of each bucket
        held: list[int] = []  # buckets loaded from and not yet released
        for b, bucket in enumerate(plan.buckets):
            k = b % self.nbuf
            want = tag(version, b)
            word = ready_word(k)
            self._release(version, held, loaded, need=b - self.nbuf)  # the sender writes b there
            if int(w[word]) != want:
                # the sender may be waiting for a bucket we hold before it publishes b: hand
                # every one back (their loads land on their own) before waiting on the sender
                self._release(version, held, loaded, need=b - 1)
                self._wait(w, word, want, version, b, deadline)
            if b == 0:
                must_wait_for_me(self.ctx, self.owner, version, w)  # before anything is loaded
            expected = int(w[word + 1]) if self.digest_kind else None
            yield Bucket(b, self.buffers[k][: bucket.nbytes], expected, generation=self.generation)
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
                raise ProtocolError(f"{self.owner}: bucket {b} of version {version} was overwritten while it was "
                                    f"loaded (the sender gave up waiting for receiver '{self.ctx.name}')")
            w[mine + 2 + k] = want
            # ring the sender's doorbell: any change of the word wakes it (shm/transport.py: wake), so racing
            # receivers need no atomic increment
            w[RELEASED] = int(w[RELEASED]) + 1
            wake(w, RELEASED)

    def _wait(self, w: np.ndarray, word: int, want: int, version: int, b: int, deadline: Deadline) -> None:
        def arrived() -> bool:
            got = int(w[word])
            if got > want:
                if b == 0:
                    must_wait_for_me(self.ctx, self.owner, version, w)  # not waited for: that is why
                raise ProtocolError(f"{self.owner}: the sender is past bucket {b} of version {version}; this receiver "
                                    f"joined the transfer late and catches up with the next version")
            return got == want

        poll_until(arrived, deadline, f"{self.owner}: bucket {b} of version {version} was not written",
                   Waiter(w, word))

    def close(self) -> None:
        if self.slot is not None and self.control is not None:
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
        self.generation += 1
        for _ in range(self.opened):
            self.ctx.account(f"{self.resource}_handles", -1)
        self.opened = 0
        for seg in self.mappings:
            seg.close()
            self.ctx.account(f"{self.resource}_control" if seg is self.control else f"{self.resource}_handles", -1)
        self.mappings.clear()
        self.control = None
