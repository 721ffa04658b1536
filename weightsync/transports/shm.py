"""Shared-memory transport: the sender writes each version once into a host segment in
/dev/shm and every receiver on the node reads it from there.

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

import errno
import fcntl
import mmap
import os
import re
import secrets
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from .. import device as devices
from ..digest import as_int, verify
from ..errors import CapacityError, DeadlineExceeded, ProtocolError
from ..plan import BucketPlan, align_up
from .base import Fill, Received, ReceiverTransport, SenderTransport, TransportContext, poll_until

MAGIC = 0x5753594E43534D31  # "WSYNCSM1"
PAGE = 4096
PREFIX = "wsync_"
SEGMENT_NAME = re.compile(r"^wsync_(\d+)_([0-9a-f]{32})$")  # wsync_<creator pid>_<128 random bits>
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


def digest_word(digest: str) -> int:
    return int(digest[:16], 16)


def segment_name() -> str:
    # 128 random bits: another user or job cannot guess the name; the pid lets a later
    # process reap segments whose creator died
    return f"{PREFIX}{os.getpid()}_{secrets.token_hex(16)}"


def reap_stale(directory: str = "/dev/shm") -> list[str]:
    """Unlink our segments whose creating process is gone; returns what was removed."""
    removed = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return removed
    for name in names:
        m = SEGMENT_NAME.match(name)
        if not m:
            continue
        try:
            os.kill(int(m.group(1)), 0)
            continue  # creator alive
        except ProcessLookupError:
            pass
        except PermissionError:
            continue  # alive, someone else's
        try:
            os.unlink(os.path.join(directory, name))
            removed.append(name)
        except FileNotFoundError:
            pass
    return removed


def our_segments(directory: str = "/dev/shm") -> list[str]:
    try:
        return sorted(n for n in os.listdir(directory) if SEGMENT_NAME.match(n))
    except FileNotFoundError:
        return []


class Segment:
    """One mapped segment. The creator owns (and unlinks) it; others attach read-only unless
    ``writable`` (the ipc transport's control block takes writes from receivers too). With
    ``header_writable`` a read-only attacher may still write the header pages (``control``)."""

    def __init__(self, path: str, size: int, create: bool, writable: bool | None = None, header_bytes: int = PAGE,
                 header_writable: bool = False):
        writable = create if writable is None else writable
        self.path, self.size, self.owner, self.writable = path, size, create, writable
        rw = writable or header_writable
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL if create else (os.O_RDWR if rw else os.O_RDONLY)
        self.fd = os.open(path, flags | getattr(os, "O_CLOEXEC", 0), 0o600)
        try:
            if create:
                os.ftruncate(self.fd, size)
                # reserve the pages now: a full /dev/shm fails here with ENOSPC, not later
                # with SIGBUS in the middle of a copy
                os.posix_fallocate(self.fd, 0, size)
            elif os.fstat(self.fd).st_size < size:
                raise ProtocolError(f"segment {os.path.basename(path)} is truncated: "
                                    f"{os.fstat(self.fd).st_size} bytes, expected {size}")
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            # MAP_POPULATE maps every page up front; the slot is reused, so this is paid once
            self.mm = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), prot=prot)
            # the header pages once more, writable: the same memory as the start of self.mm
            self.control_mm = (mmap.mmap(self.fd, header_bytes, flags=mmap.MAP_SHARED)
                               if header_writable and not writable else None)
        except BaseException:
            os.close(self.fd)
            if create:
                os.unlink(path)
            raise
        with warnings.catch_warnings():
            # receivers map read-only on purpose: an engine that wrote into a loaded view
            # would fault instead of silently corrupting the segment for other receivers
            warnings.simplefilter("ignore", UserWarning)
            self.bytes = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.words = np.frombuffer(self.mm, dtype=np.uint64, count=size // 8)
        self.header = self.words[: header_bytes // 8]
        self.control = (np.frombuffer(self.control_mm, dtype=np.uint64) if self.control_mm is not None
                        else self.header if writable else None)
        self.unpin: Callable[[], None] | None = None

    def pin(self, device: torch.device) -> None:
        """Page-lock the mapping for copies to and from ``device`` (see device.pin_host)."""
        if self.unpin is None:
            self.unpin = devices.pin_host(self.bytes, device, read_only=not self.writable)

    @property
    def name(self) -> str:
        return os.path.basename(self.path)

    def close(self) -> None:
        if self.unpin is not None:
            self.unpin()  # before the mapping goes: the driver holds its pages
            self.unpin = None
        self.bytes = self.header = self.words = self.control = None  # drop our exports so the mappings can close
        for mm in (self.mm, self.control_mm):
            try:
                if mm is not None:
                    mm.close()
            except BufferError:
                pass  # a caller still holds a view; the mapping goes when that view does
        os.close(self.fd)
        if self.owner:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


def check_space(directory: str, need: int, what: str) -> None:
    st = os.statvfs(directory)
    free = st.f_bavail * st.f_frsize
    if need > free:
        raise CapacityError(
            f"{what} needs {need / 2**20:.1f} MiB in {directory} but only {free / 2**20:.1f} MiB are free "
            f"(grow /dev/shm, e.g. docker --shm-size, or pick another transport)"
        )


class ShmSender(SenderTransport):
    name = "shm"
    pipelined = True
    # versions stay in their segments: late or restarted receivers catch up without the trainer
    keeps_versions = True

    def __init__(self, ctx: TransportContext):
        super().__init__(ctx)
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
            check_space(self.directory, self.size, f"a segment for {len(self.ctx.manifest)} tensors")
            path = os.path.join(self.directory, segment_name())
            try:
                seg = Segment(path, self.size, create=True, header_bytes=header_bytes(self.ctx.plan))
            except OSError as exc:
                if exc.errno == errno.ENOSPC:
                    raise CapacityError(f"{self.directory} ran out of space allocating {self.size} bytes") from None
                raise
            self.ctx.account("shm_segments", +1)
            seg.pin(self.ctx.device)  # the slot is reused for every later version: pinned once
            head = seg.header
            head[0], head[1], head[2] = MAGIC, digest_word(self.ctx.digest), self.ctx.plan.bucket_count
            self.slots[slot] = seg
        return seg

    def stage(self, version: int, slot: int, fill: Fill, announce: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        seg = self._slot(slot)
        head = seg.header
        count = self.ctx.plan.bucket_count
        words = head[_HEAD_WORDS: _HEAD_WORDS + _PER_BUCKET * count].reshape(count, _PER_BUCKET)
        words[:, 0] = 0  # invalidate every bucket first
        words[:, 2] = 0  # and its verification
        head[3] = version
        info = {"segment": seg.name, "size": self.size}
        announce(info)
        sums: list[int] = []
        kind = self.digest_kind
        hashed: dict[int, Any] | None = {} if kind else None
        packed, ready = 0, np.uint64(version + 1)
        for b in fill(lambda b: seg.bytes[self.bases[b]: self.bases[b] + self.ctx.plan.buckets[b].nbytes],
                      hashed, kind or "xxh3"):
            n = self.ctx.plan.buckets[b].nbytes
            word = _ready_word(b)
            if hashed is not None:  # pack_stream digested the bucket while packing it
                sums.append(as_int(hashed.pop(b)))
                head[word + 1] = sums[-1]
            if self.on_packed is not None:
                self.on_packed(version, b, seg.bytes[self.bases[b]: self.bases[b] + n])
            head[word] = ready
            packed += n
            self.packed_bytes += n
        return {**info, "checksums": sums, "packed_bytes": packed, "digest": self._record(version, sums)}

    def close(self) -> None:
        for seg in self.slots.values():
            seg.close()
            self.ctx.account("shm_segments", -1)
        self.slots.clear()


class ShmReceiver(ReceiverTransport):
    name = "shm"

    def __init__(self, ctx: TransportContext, session_info: dict[str, Any]):
        super().__init__(ctx, session_info)
        self.directory = ctx.config.shm_dir
        self.size, self.bases = layout(ctx.plan)
        self.attached: dict[str, Segment] = {}
        self._attach_lock = threading.Lock()
        # fcntl locks belong to the process, so they do not keep two threads of one receiver
        # (a user's prefetch() thread beside apply()) from hashing the same bucket twice
        self._hashing = [threading.Lock() for _ in ctx.plan.buckets]

    def _attach(self, name: str) -> Segment:
        with self._attach_lock:  # prefetch() may run in a thread beside apply()
            return self._attach_locked(name)

    def _attach_locked(self, name: str) -> Segment:
        seg = self.attached.get(name)
        if seg is None:
            if not SEGMENT_NAME.match(name):
                raise ProtocolError(f"refusing segment name {name!r}: not one of ours")
            try:
                seg = Segment(os.path.join(self.directory, name), self.size, create=False,
                              header_bytes=header_bytes(self.ctx.plan), header_writable=True)
            except FileNotFoundError:
                raise ProtocolError(f"segment {name} is gone (its sender exited?)") from None
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

    def receive(self, version: int, info: dict[str, Any], deadline: float,
                check: Callable[[], None]) -> Iterator[Received]:
        seg = self._attach(info["segment"])
        size = os.fstat(seg.fd).st_size
        if size < self.size:
            # reading a mapping past the end of its file raises SIGBUS: check before touching it
            raise ProtocolError(f"segment {seg.name} was truncated to {size} bytes; version {version} needs {self.size}")
        head = seg.header
        ready = version + 1
        sums = info.get("checksums") or None
        for b, bucket in enumerate(self.ctx.plan.buckets):
            word = _ready_word(b)
            self._wait_ready(head, word, ready, version, b, deadline, check)
            expected = int(head[word + 1]) if self.kind else None
            if sums is not None and expected is not None and sums[b] != expected:
                raise ProtocolError(f"bucket {b} of version {version}: header checksum differs from the sender's report")
            yield b, seg.bytes[self.bases[b]: self.bases[b] + bucket.nbytes], expected
            if int(head[word]) != ready:
                raise ProtocolError(f"bucket {b} of version {version} was overwritten while it was loaded")

    @staticmethod
    def _wait_ready(head: np.ndarray, word: int, ready: int, version: int, b: int,
                    deadline: float, check: Callable[[], None]) -> None:
        if int(head[word]) == ready:
            return
        # check() raises if the coordinator aborted the version (sender died, ...)
        poll_until(lambda: int(head[word]) == ready, deadline, check,
                   lambda: DeadlineExceeded(f"bucket {b} of version {version} was not written before the deadline"))

    def verify_bucket(self, version: int, info: dict[str, Any], b: int, buf: torch.Tensor, expected: int | None) -> bool:
        """Verify bucket b unless another receiver on the node already did (see module doc).
        True if this receiver hashed it."""
        if expected is None or self.kind is None:
            return False
        seg = self._attach(info["segment"])
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

    def prefetch(self, version: int, info: dict[str, Any], deadline: float, check: Callable[[], None]) -> bool:
        """Verify (and mark for the node) each bucket as soon as the sender wrote it."""
        for b, buf, expected in self.receive(version, info, deadline, check):
            self.verify_bucket(version, info, b, buf, expected)
        return True

    def span(self, version: int, info: dict[str, Any]) -> Callable[[int, int, int], torch.Tensor | None]:
        return spans(self._attach(info["segment"]).bytes, self.bases, self.ctx.plan)

    def can_replay(self, version: int, info: dict[str, Any]) -> bool:
        name = info.get("segment")
        if not name:
            return False
        try:
            seg = self._attach(name)
        except ProtocolError:
            return False
        head = seg.header
        return int(head[3]) == version and all(
            int(head[_ready_word(b)]) == version + 1 for b in range(self.ctx.plan.bucket_count)
        )

    def close(self) -> None:
        for seg in self.attached.values():
            seg.close()
            self.ctx.account("shm_mappings", -1)
        self.attached.clear()
