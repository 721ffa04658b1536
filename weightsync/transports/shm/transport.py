"""Internal. Shared-memory transport: the sender writes each version once into a host segment
(a memfd, or a file in /dev/shm: transports/memory.py) and every receiver on the node reads it
from there; or, when whole versions do not fit the node's shared-memory budget, it streams each
version through a ring of K host bucket buffers instead.

Segments are slots reused across versions (allocated once, not per version). The
coordinator picks the slot so that the version any receiver serves stays intact: a receiver
that fails part-way re-reads its previous version (rollback), and one that joins late reads
the latest committed version, all without the trainer.

Segment layout: header pages of uint64 words (as many as the bucket count needs), then the
buckets, each page-aligned.
  [0] magic  [1] layout digest  [2] bucket count  [3] version being written
  [8 + 3b] version + 1 once bucket b is complete (0 while it is written)  [9 + 3b] its digest
  [10 + 3b] version + 1 once a receiver verified bucket b's digest (xxh3 under auto: host)
The sender writes the bytes of a bucket, then its digest, then its ready word, so a
receiver may read bucket b as soon as the word says so: staging and receiving overlap.
A bucket's digest is verified once per node, not per receiver: under a lock on its verified
word (fcntl, released if the holder dies), the first receiver digests it and marks it; the
others see the mark and load. One that finds a bad digest marks nothing: all check for themselves.

The registry's "shm" entry is :func:`open_shm_sender` / :func:`open_shm_receiver` here: the
mode is decided once, when the sender is built, from the plan and the budget, and receivers
follow the sender's choice as it published it:

  budget     ``shm_budget_mb``, or when 0 (auto) AUTO_FRACTION of what the node can give:
             MemAvailable (or a memory cgroup's room), and for segment files no more than the
             free space of ``shm_dir``; the models beside it need the rest
  whole      when ``shm_max_segments`` x segment size <= budget (a segment: the layout above,
             one version)
  streaming  otherwise: K = (budget - control block) // bucket buffer (the largest bucket,
             page-aligned), clamped to [2, ipc.wire.MAX_BUFFERS] and to the bucket count; a
             budget without room for 2 buffers is a CapacityError that says what to set

A streaming sender and its receivers each own one end of the ring the ipc transport moves its
versions through (ipc/ring.py: control block, per-receiver release words, the sender overwrites
a buffer only once every participating receiver released it, failed receivers are not waited
for), with K buffers kept in host shared memory even on an accelerator node, so the digest is
xxh3 as for whole versions. It gives up what ipc gives up: nothing is kept (no rollback to the
previous version, a late joiner waits for the next version, the coordinator pins no slot), and
the bytes move in ``sync()``, so the trainer's tensors are read then and must not change until
it returns.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import errno
import fcntl
import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from ... import digest
from ...config import MiB, SyncConfig
from ...errors import CapacityError, ProtocolError
from ...manifest import BucketPlan, Packer, PackViews, align_up, size_text
from ...records import VersionRecord
from ..base import Bucket, Deadline, ReceiverTransport, SenderTransport, Span, TransportContext
from ..ipc.transport import RingReceiver, RingSender
from ..ipc.wire import CONTROL_BYTES, MAX_BUFFERS, in_flight
from ..memory import (
    PAGE,
    Segment,
    Waiter,
    attach,
    create,
    digest_word,
    memory_available,
    poll_until,
    reap_stale,
    resolve_backing,
    wake,
)
from .on_device import DeviceBuffers, HostCopies, hashes_on_device
from .records import ShmSession, ShmStreamSession, ShmStreamVersion, ShmVersion


def lock_word(fd: int, word: int) -> None:
    """Take the byte-range lock on control word ``word`` of the segment, waiting for its holder.

    POSIX record locks belong to the process, not the thread, so the kernel's deadlock check
    sees one waiter where our hash threads are several: receiver A's thread holds bucket 3 and
    its other thread waits for bucket 4, held by receiver B, whose other thread now asks for
    bucket 3: EDEADLK, though A's first thread releases bucket 3 as soon as its hash is done.
    Seen with four receivers on an H200 node. Each thread holds one word at a time, so no
    true deadlock exists: ask again until the holder is done."""
    while True:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX, 8, 8 * word)
            return
        except OSError as exc:
            if exc.errno != errno.EDEADLK:
                raise
            time.sleep(0.001)


MAGIC = 0x5753594E43534D31  # "WSYNCSM1"
# Threads that digest written buckets ahead of the one being loaded. xxh3 releases the GIL, so
# they run beside the load and beside each other: on a GPU node host hashing was most of shm's
# time (0.19 s of a 0.31 s version of 1.17 GiB, one H200); one core stays for the loading thread
HASH_THREADS = max(1, min(4, (os.cpu_count() or 2) - 1))
_HEAD_WORDS = 8
_PER_BUCKET = 3  # ready, digest, verified


def _ready_word(b: int) -> int:
    return _HEAD_WORDS + _PER_BUCKET * b


def header_bytes(plan: BucketPlan) -> int:
    return align_up(8 * (_HEAD_WORDS + _PER_BUCKET * plan.bucket_count), PAGE)


def layout(plan: BucketPlan) -> tuple[int, list[int]]:
    """(segment size, byte offset of each bucket) for a plan."""
    offset = header_bytes(plan)
    bases = []
    for b in plan.buckets:
        bases.append(offset)
        offset += align_up(max(b.nbytes, 1), PAGE)
    return offset, bases


def spans(buf: torch.Tensor, bases: list[int], plan: BucketPlan) -> Callable[[int, int, int], torch.Tensor | None]:
    """Unpacker's ``span`` over a buffer laid out by :func:`layout`: a view of ``nbytes`` from
    ``offset`` in ``bucket`` on through the next buckets, or None where they are not back to back."""
    buckets = plan.buckets

    def view(bucket: int, offset: int, nbytes: int) -> torch.Tensor | None:
        start, end = bases[bucket] + offset, bases[bucket] + offset + nbytes
        # buckets sit back to back only where each one before the last is full to a page edge
        b = bucket
        while bases[b] + buckets[b].nbytes < end:
            if b + 1 >= len(bases) or bases[b] + buckets[b].nbytes != bases[b + 1]:
                return None
            b += 1
        return buf[start:end]

    return view


class ShmSender(SenderTransport):
    """Whole versions: each version packed once into a slot's segment, in stage()."""

    def __init__(self, ctx: TransportContext, why: str = "shm whole versions"):
        self.ctx = ctx
        # hashed where the tensors are (on_device.py on an accelerator node), host memory on a CPU
        kind = digest.kind_of(ctx.config, ctx.device)
        # versions stay in their segments: late or restarted receivers catch up without the
        # trainer; receivers verify a segment ahead (prefetch), nothing else is sent
        self.session = ShmSession(digest_kind=kind, keeps_versions=True, ahead=True, why=why)
        # on an accelerator node each bucket is digested on the device before its copy to the host
        self.on_device = DeviceBuffers(ctx) if hashes_on_device(ctx, kind) else None
        self.directory = ctx.config.shm_dir
        reap_stale(self.directory)
        self.size, self.bases = layout(ctx.plan)
        self.slots: dict[int, Segment] = {}
        self.views = PackViews()  # where each bucket's tensors go in each slot, made once
        self.announced: tuple[int, Segment] | None = None
        # bytes this sender packed into segments, all versions together: everything the
        # trainer writes happens in stage(); tests check that the barrier adds nothing
        self.packed_bytes = 0

    def _slot(self, slot: int) -> Segment:
        seg = self.slots.get(slot)
        if seg is None:
            seg = create(self.ctx.config, self.size, f"a segment for {len(self.ctx.manifest)} tensors",
                         header_bytes=header_bytes(self.ctx.plan))
            self.ctx.account("shm_segments", +1)
            seg.pin(self.ctx.device)  # the slot is reused for every later version: pinned once
            head = seg.header
            head[0], head[1], head[2] = MAGIC, digest_word(self.ctx.digest), self.ctx.plan.bucket_count
            self.slots[slot] = seg
        return seg

    def announce(self, version: int, slot: int) -> ShmVersion:
        """Invalidate the slot's buckets for ``version``: receivers may read each one from here
        on, as soon as its ready word is set."""
        seg = self._slot(slot)
        head = seg.header
        count = self.ctx.plan.bucket_count
        words = head[_HEAD_WORDS: _HEAD_WORDS + _PER_BUCKET * count].reshape(count, _PER_BUCKET)
        words[:, 0] = 0  # invalidate every bucket first
        words[:, 2] = 0  # and its verification
        head[3] = version
        self.announced = (version, seg)
        return ShmVersion(segment=seg.ref, size=self.size)

    def stage(self, version: int, slot: int, packer: Packer) -> ShmVersion:
        if self.announced is None or self.announced[0] != version:
            self.announce(version, slot)
        seg = self.announced[1]
        head, kind, plan = seg.header, self.session.digest_kind, packer.plan  # the packer's wire lengths
        ready = np.uint64(version + 1)
        sums: list[int] = []

        def publish(b: int, value: int | None) -> None:
            word = _ready_word(b)
            if value is not None:
                sums.append(value)
                head[word + 1] = value
            head[word] = ready
            wake(head, word)  # receivers sleeping on the word (memory.py)
            self.packed_bytes += plan.buckets[b].nbytes

        if self.on_device is not None:
            run = HostCopies(self.on_device, plan)
            for b in range(plan.bucket_count):
                landed, buf = run.claim(b)
                for item in landed:
                    publish(*item)
                run.done(b, packer.fill(b, buf, kind, self.on_device.views), self._view(seg, b, plan))
            for item in run.landed(plan.bucket_count - 1):
                publish(*item)
        else:
            for b in range(plan.bucket_count):
                value = packer.fill(b, self._view(seg, b, plan), kind, self.views)  # hashed as it packed
                publish(b, digest.as_int(value) if kind else None)
        self.announced = None
        packed = sum(bucket.nbytes for bucket in plan.buckets)
        return ShmVersion(segment=seg.ref, size=self.size, checksums=sums, packed_bytes=packed,
                          digest=digest.version_digest(kind, sums) if kind else None)

    def _view(self, seg: Segment, b: int, plan: BucketPlan) -> torch.Tensor:
        return seg.bytes[self.bases[b]: self.bases[b] + plan.buckets[b].nbytes]

    def send(self, version: int, deadline: Deadline) -> str | None:
        return None  # every byte moved in stage()

    def close(self) -> None:
        self.views.clear()
        if self.on_device is not None:
            self.on_device.close()
        for seg in self.slots.values():
            seg.close()
            self.ctx.account("shm_segments", -1)
        self.slots.clear()


PAGE_BYTES = 4096


class ShmReceiver(ReceiverTransport):
    """A reader of whole versions from the sender's segments; verifies each bucket once per node
    (module doc) on its way in, and keeps the segments mapped for rollback and catch-up."""

    def __init__(self, ctx: TransportContext, session: ShmSession):
        self.ctx = ctx
        self.digest_kind = ctx.digest_kind  # None where this receiver's config turns digests off
        self.directory = ctx.config.shm_dir
        self.size, self.bases = layout(ctx.plan)
        self.attached: dict[str, Segment] = {}
        self._attach_lock = threading.Lock()
        # fcntl locks belong to the process, so they do not keep two threads of one receiver
        # (a user's prefetch() thread beside apply()) from hashing the same bucket twice
        self._hashing = [threading.Lock() for _ in ctx.plan.buckets]
        # (version, bucket) -> its digest check, started as soon as the bucket was written
        self._ahead: dict[tuple[int, int], concurrent.futures.Future] = {}
        self._ahead_lock = threading.Lock()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._generation = 0  # bumped whenever a mapping goes (Bucket.generation)
        self.verified_ahead: int | None = None
        # torch digests on an accelerator: each bucket is copied to the device and checked there
        self.on_device = DeviceBuffers(ctx) if hashes_on_device(ctx, self.digest_kind) else None

    def _attach(self, name: str) -> Segment:
        with self._attach_lock:  # prefetch() may run in a thread beside apply()
            return self._attach_locked(name)

    def _attach_locked(self, name: str) -> Segment:
        seg = self.attached.get(name)
        if seg is None:
            seg = attach(name, self.directory, self.size, header_bytes=header_bytes(self.ctx.plan),
                         header_writable=True)
            if seg.header[0] != MAGIC or seg.header[1] != digest_word(self.ctx.digest):
                seg.close()
                raise ProtocolError(f"segment {name} holds another layout than this session's manifest")
            if len(self.attached) >= self.ctx.config.shm_max_segments:
                # the sender recycles at most shm_max_segments slots; drop the oldest mapping
                oldest = next(iter(self.attached))
                self.attached.pop(oldest).close()
                self._generation += 1
                self.ctx.account("shm_mappings", -1)
            seg.pin(self.ctx.device)
            self.attached[name] = seg
            self.ctx.account("shm_mappings", +1)
        return seg

    def receive(self, version: int, record: VersionRecord, deadline: Deadline) -> Iterator[Bucket]:
        if not isinstance(record, ShmVersion):
            raise ProtocolError(f"shm: version {version} is published in streaming mode, but this receiver attached "
                                f"to a whole-version session; restart the receiver")
        seg = self._attach(record.segment)
        size = os.fstat(seg.fd).st_size
        if size < self.size:
            # reading a mapping past the end of its file raises SIGBUS: check before touching it
            raise ProtocolError(f"segment {seg.name} was truncated to {size} bytes; version {version} needs {self.size}")
        if self.on_device is not None:
            yield from self._receive_on_device(version, record, seg, deadline)
            return
        head = seg.header
        ready = version + 1
        sums = record.checksums or None
        buckets = record.moves(self.ctx.plan).buckets
        started: list[tuple[int, int]] = []
        try:
            for b, bucket in enumerate(buckets):
                word = _ready_word(b)
                self._wait_ready(head, word, ready, version, b, deadline)
                expected = self._expected(head, word, sums, version, b)
                view = self._view(seg, b, bucket.nbytes)
                checked = ""
                if expected is not None:
                    started += self._hash_ahead(version, record, seg, buckets, b)
                    checked = "here" if self._verified(version, record, b, view, expected) else "peer"
                yield Bucket(b, view, expected, checked, self._generation)
                if int(head[word]) != ready:
                    raise ProtocolError(f"bucket {b} of version {version} was overwritten while it was loaded")
        finally:
            # a hashing thread must not read a mapping after its version was given up or closed
            with self._ahead_lock:
                pending = [f for f in (self._ahead.pop(key, None) for key in started) if f is not None]
            for f in pending:
                f.cancel()
            concurrent.futures.wait(pending)

    def _receive_on_device(self, version: int, record: ShmVersion, seg: Segment, deadline: Deadline) -> Iterator[Bucket]:
        """Each bucket, once written, copied from the segment into a device buffer of this
        receiver's device once the loads out of the bucket two before landed, and yielded from
        there: what the receiver verifies is what the engine loads (on_device.py)."""
        head, ready, sums = seg.header, version + 1, record.checksums or None
        plan = record.moves(self.ctx.plan)
        buffers = self.on_device
        for b, dst, loaded in buffers.receiving(plan):
            word = _ready_word(b)
            self._wait_ready(head, word, ready, version, b, deadline)
            expected = self._expected(head, word, sums, version, b)
            dst.copy_(self._view(seg, b, plan.buckets[b].nbytes), non_blocking=True)
            yield Bucket(b, dst, expected, "", buffers.generation)  # its check is of this copy, the receiver's
            loaded.mark(b)
        for b in range(plan.bucket_count):
            if int(head[_ready_word(b)]) != ready:
                raise ProtocolError(f"bucket {b} of version {version} was overwritten while it was loaded")

    def _expected(self, head: np.ndarray, word: int, sums: list[int] | None, version: int, b: int) -> int | None:
        """The digest the sender wrote for bucket b (None: digests off here)."""
        expected = int(head[word + 1]) if self.digest_kind else None
        if sums is not None and expected is not None and sums[b] != expected:
            raise ProtocolError(f"bucket {b} of version {version}: header checksum differs from the sender's report")
        return expected

    def _hash_ahead(self, version: int, record: ShmVersion, seg: Segment, buckets: Any, b: int) -> list[tuple[int, int]]:
        """Start the digest check of the written buckets from b on, up to HASH_THREADS + 1 of
        them, so they are verified while earlier ones load. Returns the keys it started."""
        head, ready, started = seg.header, version + 1, []
        with self._ahead_lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="weightsync-shm-hash")
            for k in range(b, min(len(buckets), b + HASH_THREADS + 1)):
                word = _ready_word(k)
                if (version, k) in self._ahead or int(head[word]) != ready:
                    continue
                self._ahead[(version, k)] = self._pool.submit(self._verify_here, version, record, k,
                                                             self._view(seg, k, buckets[k].nbytes), int(head[word + 1]))
                started.append((version, k))
        return started

    def _view(self, seg: Segment, b: int, nbytes: int) -> torch.Tensor:
        return seg.bytes[self.bases[b]: self.bases[b] + nbytes]

    @staticmethod
    def _wait_ready(head: np.ndarray, word: int, ready: int, version: int, b: int, deadline: Deadline) -> None:
        if int(head[word]) == ready:
            return
        # the deadline's check raises if the coordinator aborted the version (sender died, ...)
        poll_until(lambda: int(head[word]) == ready, deadline, f"bucket {b} of version {version} was not written",
                   Waiter(head, word))

    def _verified(self, version: int, record: ShmVersion, b: int, buf: torch.Tensor, expected: int) -> bool:
        """Verify bucket b unless another receiver on the node already did (module doc); True if
        this receiver hashed it. A ChecksumError is raised here, in bucket order."""
        with self._ahead_lock:
            started = self._ahead.pop((version, b), None)
        return started.result() if started is not None else self._verify_here(version, record, b, buf, expected)

    def _verify_here(self, version: int, record: ShmVersion, b: int, buf: torch.Tensor, expected: int) -> bool:
        seg = self._attach(record.segment)
        word, mark = _ready_word(b) + 2, np.uint64(version + 1)
        if seg.control[word] == mark:
            return False
        with self._hashing[b]:
            # a byte-range lock on the word: one hasher per bucket; the kernel drops it if we die
            lock_word(seg.fd, word)
            try:
                if seg.control[word] == mark:
                    return False
                digest.verify(self.digest_kind, b, buf, expected, version)
                seg.control[word] = mark
                return True
            finally:
                fcntl.lockf(seg.fd, fcntl.LOCK_UN, 8, 8 * word)

    def open_ahead(self) -> int | None:
        # the segment holds the whole version already: ahead is verifying it (prefetch); what a
        # receiver digesting on its device checks is its own copy, made at the barrier
        if self.on_device is not None:
            return None
        return 0 if self.ctx.config.receive_ahead != "off" and self.digest_kind is not None else None

    def prefetch(self, version: int, record: VersionRecord, deadline: Deadline) -> bool:
        """Verify (and mark for the node) each bucket as soon as the sender wrote it. With
        receive_ahead, also map every page of it into this process (one byte read per page):
        the receiver that did not hash a bucket would otherwise take its page faults in the
        barrier's load."""
        if self.on_device is not None or self.digest_kind is None:
            return False  # its check is of the copy on the device, made when the version is loaded
        touch = self.ctx.config.receive_ahead != "off"
        for bucket in self.receive(version, record, deadline):
            if touch and bucket.data.numel():
                bucket.data[::PAGE_BYTES].max()
        self.verified_ahead = version
        return True

    def received_ahead(self, version: int, record: VersionRecord) -> bool:
        return self.verified_ahead == version

    def span(self, version: int, record: VersionRecord) -> Span | None:
        if not isinstance(record, ShmVersion) or self.on_device is not None:
            return None  # receive() says why; or loads come from the device buffers, bucket by bucket
        return spans(self._attach(record.segment).bytes, self.bases, self.ctx.plan)

    def can_replay(self, version: int, record: VersionRecord) -> bool:
        if not isinstance(record, ShmVersion):
            return False
        try:
            seg = self._attach(record.segment)
        except ProtocolError:
            return False
        head = seg.header
        return int(head[3]) == version and all(
            int(head[_ready_word(b)]) == version + 1 for b in range(self.ctx.plan.bucket_count)
        )

    def close(self) -> None:
        if self.on_device is not None:
            self.on_device.close()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)  # before the mappings they read go
        for seg in self.attached.values():
            seg.close()
            self.ctx.account("shm_mappings", -1)
        self.attached.clear()
        self._generation += 1


# -- the mode: whole versions or a streaming ring, from the budget ---------------------------------

AUTO_FRACTION = 0.5
MIN_BUFFERS = 2  # one being written while receivers read the other


@dataclasses.dataclass(frozen=True)
class ShmMode:
    streaming: bool
    buffers: int  # ring slots (streaming); 0 in whole-version mode
    need_bytes: int  # shared memory the mode takes at most: slots x segment, or ring + control block
    reason: str  # shown in status() as part of the transport reason


def node_capacity(config: SyncConfig) -> int:
    """Bytes the node can give to shared memory now: what the kernel can give (MemAvailable, or a
    memory cgroup's room), and for segment files no more than the free space of ``shm_dir``."""
    can = memory_available()[0]
    if resolve_backing(config.shm_backing, config.shm_dir)[0] == "files":
        st = os.statvfs(config.shm_dir)
        can = min(can, st.f_bavail * st.f_frsize)
    return can


def budget(config: SyncConfig, capacity: Callable[[SyncConfig], int] = node_capacity,
           reserve: int = 0) -> tuple[int, str]:
    """(budget in bytes, where it comes from). ``reserve``: host memory the trainer holds
    beside the segments (delta sync's snapshot), taken from what the node can give first."""
    if config.shm_budget_mb > 0:
        return int(config.shm_budget_mb * MiB), f"shm_budget_mb={config.shm_budget_mb:g}"
    can = max(0, capacity(config) - reserve)
    beside = f" beside delta sync's {size_text(reserve)} host snapshot" if reserve else ""
    return int(can * AUTO_FRACTION), f"auto: {AUTO_FRACTION:g} x {size_text(can)} the node can give{beside}"


def choose_mode(plan: BucketPlan, config: SyncConfig, capacity: Callable[[SyncConfig], int] = node_capacity,
                reserve: int = 0) -> ShmMode:
    """``reserve``: what the sender's packing keeps in host memory on this node (TransportContext.host_reserve),
    out of the same budget."""
    limit, source = budget(config, capacity, reserve)
    segment = layout(plan)[0]
    slots = config.shm_max_segments
    whole = slots * segment
    if whole <= limit:
        return ShmMode(False, 0, whole, f"shm whole versions: {slots} x {size_text(segment)} = {size_text(whole)} "
                                        f"within the budget of {size_text(limit)} ({source})")
    buffer = align_up(max([b.nbytes for b in plan.buckets] + [1]), PAGE)
    control = align_up(CONTROL_BYTES, PAGE)
    fits = max(0, limit - control) // buffer
    if fits < MIN_BUFFERS:
        least = MIN_BUFFERS * buffer + control
        raise CapacityError(
            f"shm: the budget of {size_text(limit)} ({source}) holds neither {slots} whole versions "
            f"({slots} x {size_text(segment)}) nor a ring of {MIN_BUFFERS} bucket buffers of {size_text(buffer)} "
            f"plus a {size_text(control)} control block: set shm_budget_mb >= {math.ceil(least * 100 / MiB) / 100:g}, "
            f"or a smaller "
            f"bucket_mb{', or free memory / grow ' + config.shm_dir if config.shm_budget_mb == 0 else ''}")
    k = max(1, min(fits, in_flight(MAX_BUFFERS), plan.bucket_count))  # WEIGHTSYNC_RING_BUFFERS may cap it to measure
    return ShmMode(True, k, k * buffer + control,
                   f"shm streaming: whole versions need {size_text(whole)} ({slots} x {size_text(segment)}), budget "
                   f"{size_text(limit)} ({source}); ring of {k} x {size_text(buffer)}; keeps no version (no "
                   f"rollback, late joiners wait for the next version, tensors are read during sync())")


# -- streaming: one end of a ring of K host bucket buffers (ipc/ring.py) -------------------------


class ShmStreamSender(RingSender):
    """shm in streaming mode: the writing end of a ring of K buffers in host shared memory, even
    on an accelerator node."""

    name = "shm"
    resource = "shm_ring"
    session_type = ShmStreamSession
    version_type = ShmStreamVersion

    def __init__(self, ctx: TransportContext, mode: ShmMode):
        super().__init__(ctx, mode.buffers, torch.device("cpu"), why=mode.reason)


class ShmStreamReceiver(RingReceiver):
    """shm in streaming mode: a reading end of the sender's ring, loading onto any device."""

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


# -- the two ends of "shm": the mode -------------------------------------------------------------


def open_sender(ctx: TransportContext) -> SenderTransport:
    """Whole versions where they fit the budget, else the streaming ring."""
    mode = choose_mode(ctx.plan, ctx.config, reserve=ctx.host_reserve)
    return ShmStreamSender(ctx, mode) if mode.streaming else ShmSender(ctx, mode.reason)


def open_receiver(ctx: TransportContext, session: ShmSession | ShmStreamSession) -> ReceiverTransport:
    """The receiver of the mode the sender published."""
    return ShmStreamReceiver(ctx, session) if isinstance(session, ShmStreamSession) else ShmReceiver(ctx, session)
