"""Shared-memory transport: the sender writes each version once into a host segment
(a memfd, or a file in /dev/shm: transports/memory.py) and every receiver on the node reads it
from there.

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
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import fcntl
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch

from ...digest import as_int, verify
from ...errors import DeadlineExceeded, ProtocolError
from ...manifest import BucketPlan, BucketSink, Packing, align_up
from .. import memory as notify  # wake-ups on segment words (memory.py)
from ..base import (
    Received,
    ReceiverTransport,
    SenderTransport,
    ShmSession,
    ShmStreamVersion,
    ShmVersion,
    TransportContext,
    VersionRecord,
    poll_until,
    shm_version,
)
from ..memory import PAGE, Segment, attach, create, digest_word, reap_stale

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


class _SegmentSink(BucketSink):
    """Packs into a slot's segment, bucket b at its page-aligned base."""

    def __init__(self, seg: Segment, bases: list[int], plan: BucketPlan):
        self.seg, self.bases, self.plan = seg, bases, plan
        self.digests: dict[int, Any] = {}

    def buffer(self, b: int) -> torch.Tensor:
        return self.seg.bytes[self.bases[b]: self.bases[b] + self.plan.buckets[b].nbytes]

    def done(self, b: int, digest: int | torch.Tensor | None) -> None:
        if digest is not None:
            self.digests[b] = digest


class ShmSender(SenderTransport):
    name = "shm"
    session_record = ShmSession
    version_record = ShmVersion
    pipelined = True
    # versions stay in their segments: late or restarted receivers catch up without the trainer
    keeps_versions = True
    ahead_capable = True  # receivers verify the segment ahead (prefetch); nothing else to send

    def __init__(self, ctx: TransportContext, mode_reason: str = "shm whole versions"):
        super().__init__(ctx)
        # why whole versions (shm_stream.open_shm_sender decides the mode; shown in status())
        self.mode_reason = mode_reason
        self.directory = ctx.config.shm_dir
        reap_stale(self.directory)
        self.size, self.bases = layout(ctx.plan)
        self.slots: dict[int, Segment] = {}
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

    def stage(self, version: int, slot: int, packing: Packing,
              announce: Callable[[VersionRecord], None]) -> ShmVersion:
        seg = self._slot(slot)
        head = seg.header
        count = self.ctx.plan.bucket_count
        words = head[_HEAD_WORDS: _HEAD_WORDS + _PER_BUCKET * count].reshape(count, _PER_BUCKET)
        words[:, 0] = 0  # invalidate every bucket first
        words[:, 2] = 0  # and its verification
        head[3] = version
        early = ShmVersion(segment=seg.ref, size=self.size)
        announce(early)
        sums: list[int] = []
        sink = _SegmentSink(seg, self.bases, packing.plan)  # the packing's wire lengths (shorter where its buckets are encoded)
        packed, ready = 0, np.uint64(version + 1)
        for b in packing.into(sink, self.digest_kind):
            n = packing.plan.buckets[b].nbytes
            word = _ready_word(b)
            if self.digest_kind:  # pack_stream digested the bucket while packing it
                sums.append(as_int(sink.digests.pop(b)))
                head[word + 1] = sums[-1]
            head[word] = ready
            notify.wake(head, word)  # receivers sleeping on the word (transports/notify.py)
            packed += n
            self.packed_bytes += n
        return dataclasses.replace(early, checksums=sums, packed_bytes=packed, digest=self._record(version, sums))

    def close(self) -> None:
        for seg in self.slots.values():
            seg.close()
            self.ctx.account("shm_segments", -1)
        self.slots.clear()


PAGE_BYTES = 4096


class ShmReceiver(ReceiverTransport):
    name = "shm"
    session_record = ShmSession
    version_record = ShmVersion

    def __init__(self, ctx: TransportContext, wire: Mapping[str, Any]):
        super().__init__(ctx, wire)
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
                self.ctx.account("shm_mappings", -1)
            seg.pin(self.ctx.device)
            self.attached[name] = seg
            self.ctx.account("shm_mappings", +1)
        return seg

    def parse_version(self, wire: Mapping[str, Any]) -> ShmVersion | ShmStreamVersion:
        return shm_version(wire)  # either mode: receive() tells a mode change from a malformed record

    def receive(self, version: int, info: VersionRecord, deadline: float,
                check: Callable[[], None]) -> Iterator[Received]:
        if not isinstance(info, ShmVersion):
            raise ProtocolError(f"shm: version {version} is published in streaming mode, but this receiver attached "
                                f"to a whole-version session; restart the receiver")
        seg = self._attach(info.segment)
        size = os.fstat(seg.fd).st_size
        if size < self.size:
            # reading a mapping past the end of its file raises SIGBUS: check before touching it
            raise ProtocolError(f"segment {seg.name} was truncated to {size} bytes; version {version} needs {self.size}")
        head = seg.header
        ready = version + 1
        sums = info.checksums or None
        buckets = self.plan_of(info).buckets
        started: list[tuple[int, int]] = []
        try:
            for b, bucket in enumerate(buckets):
                word = _ready_word(b)
                self._wait_ready(head, word, ready, version, b, deadline, check)
                expected = int(head[word + 1]) if self.kind else None
                if sums is not None and expected is not None and sums[b] != expected:
                    raise ProtocolError(f"bucket {b} of version {version}: header checksum differs from the "
                                        f"sender's report")
                if expected is not None:
                    started += self._hash_ahead(version, info, seg, buckets, b)
                yield b, self._view(seg, b, bucket.nbytes), expected
                if int(head[word]) != ready:
                    raise ProtocolError(f"bucket {b} of version {version} was overwritten while it was loaded")
        finally:
            # a hashing thread must not read a mapping after its version was given up or closed
            with self._ahead_lock:
                pending = [f for f in (self._ahead.pop(key, None) for key in started) if f is not None]
            for f in pending:
                f.cancel()
            concurrent.futures.wait(pending)

    def _hash_ahead(self, version: int, info: ShmVersion, seg: Segment, buckets: Any, b: int) -> list[tuple[int, int]]:
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
                self._ahead[(version, k)] = self._pool.submit(self._verify_here, version, info, k,
                                                             self._view(seg, k, buckets[k].nbytes), int(head[word + 1]))
                started.append((version, k))
        return started

    def _view(self, seg: Segment, b: int, nbytes: int) -> torch.Tensor:
        return seg.bytes[self.bases[b]: self.bases[b] + nbytes]

    @staticmethod
    def _wait_ready(head: np.ndarray, word: int, ready: int, version: int, b: int,
                    deadline: float, check: Callable[[], None]) -> None:
        if int(head[word]) == ready:
            return
        # check() raises if the coordinator aborted the version (sender died, ...)
        poll_until(lambda: int(head[word]) == ready, deadline, check,
                   lambda: DeadlineExceeded(f"bucket {b} of version {version} was not written before the deadline"),
                   waiter=notify.Waiter(head, word))

    def verify_bucket(self, version: int, info: ShmVersion, b: int, buf: torch.Tensor, expected: int | None) -> bool:
        """Verify bucket b unless another receiver on the node already did (see module doc).
        True if this receiver hashed it."""
        if expected is None or self.kind is None:
            return False
        with self._ahead_lock:
            started = self._ahead.pop((version, b), None)
        if started is not None:
            return started.result()  # its ChecksumError, if any, is raised here, in bucket order
        return self._verify_here(version, info, b, buf, expected)

    def _verify_here(self, version: int, info: ShmVersion, b: int, buf: torch.Tensor, expected: int) -> bool:
        seg = self._attach(info.segment)
        word, mark = _ready_word(b) + 2, np.uint64(version + 1)
        if seg.control[word] == mark:
            return False
        with self._hashing[b]:
            # a byte-range lock on the word: one hasher per bucket; the kernel drops it if we die
            fcntl.lockf(seg.fd, fcntl.LOCK_EX, 8, 8 * word)
            try:
                if seg.control[word] == mark:
                    return False
                verify(self.kind, b, buf, expected, version)
                seg.control[word] = mark
                return True
            finally:
                fcntl.lockf(seg.fd, fcntl.LOCK_UN, 8, 8 * word)

    def open_ahead(self) -> int | None:
        # the segment holds the whole version already: ahead is verifying it (prefetch)
        return 0 if self.ctx.config.receive_ahead != "off" and self.kind is not None else None

    def prefetch(self, version: int, info: ShmVersion, deadline: float, check: Callable[[], None]) -> bool:
        """Verify (and mark for the node) each bucket as soon as the sender wrote it. With
        receive_ahead, also map every page of it into this process (one byte read per page):
        the receiver that did not hash a bucket would otherwise take its page faults in the
        barrier's load."""
        touch = self.ctx.config.receive_ahead != "off"
        for b, buf, expected in self.receive(version, info, deadline, check):
            self.verify_bucket(version, info, b, buf, expected)
            if touch and buf.numel():
                buf[::PAGE_BYTES].max()
        self.verified_ahead = version
        return True

    def received_ahead(self, version: int, info: VersionRecord) -> bool:
        return getattr(self, "verified_ahead", None) == version

    def span(self, version: int, info: VersionRecord) -> Callable[[int, int, int], torch.Tensor | None] | None:
        if not isinstance(info, ShmVersion):
            return None  # receive() says why
        return spans(self._attach(info.segment).bytes, self.bases, self.ctx.plan)

    def can_replay(self, version: int, info: VersionRecord) -> bool:
        if not isinstance(info, ShmVersion):
            return False
        try:
            seg = self._attach(info.segment)
        except ProtocolError:
            return False
        head = seg.header
        return int(head[3]) == version and all(
            int(head[_ready_word(b)]) == version + 1 for b in range(self.ctx.plan.bucket_count)
        )

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)  # before the mappings they read go
        for seg in self.attached.values():
            seg.close()
            self.ctx.account("shm_mappings", -1)
        self.attached.clear()
