"""Internal. The broadcast receiver's copy of one version taken ahead (config ``receive_ahead``): the
version's buckets, back to back, taken and verified while the engine still serves the version
before, so the barrier only loads. One version at a time: the next one overwrites it, which is
safe because a version is only staged once the one before has settled on every receiver.

The copy records a version's outcome, not just its bytes: a bucket that failed its digest on the
way in fails the version when apply() comes for it, and nothing of it reached the engine
(all-or-nothing, as at the barrier).

On a device (CUDA, NPU, any registered accelerator) the copy is written on a stream of its own,
made once (``writing()``): on the engine's stream, the default one on CUDA, the transfer would
queue behind the generation it is meant to overlap, and the generation behind it. The two
streams meet only through events, never a host wait on the engine's side: the barrier's loads
wait for the event recorded after the version's last bytes landed in the copy (and were
verified), and the next version's writes wait for the event recorded after the barrier queued
its last load from it.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch

from ... import device as devices
from ...config import MiB, SyncConfig
from ...errors import CapacityError, VersionError
from ...manifest import BucketPlan
from .. import Bucket, Deadline, Span
from ..shm.transport import memory_available, spans


def bound(config: SyncConfig) -> tuple[int, str]:
    """The bytes an ahead copy may take on this node, and where the figure comes from."""
    if config.receive_ahead_max_mb > 0:
        return int(config.receive_ahead_max_mb * MiB), f"receive_ahead_max_mb={config.receive_ahead_max_mb:g}"
    room, source = memory_available()
    return room // 2, f"half of {source} ({room / MiB:.0f} MiB; receive_ahead_max_mb=0)"


class AheadCopy:
    """One version's buckets in one buffer on ``device``; sized by the session ``plan``."""

    def __init__(self, plan: BucketPlan, device: torch.device, who: str, config: SyncConfig):
        self.plan = plan
        self.bases, at = [], 0
        for b in plan.buckets:
            self.bases.append(at)
            at += b.nbytes
        self.nbytes = at
        limit, source = bound(config)
        if self.nbytes > limit:
            raise CapacityError(f"{who}: receive_ahead needs an ahead copy of {self.nbytes / MiB:.1f} MiB (one copy of the "
                                f"payload) but may take {limit / MiB:.1f} MiB ({source}); raise receive_ahead_max_mb "
                                f"or set receive_ahead: off (or auto, which takes versions at the barrier instead)")
        self.device = torch.device(device)
        self.stream = devices.new_stream(self.device) if devices.has_streams(self.device) else None
        with self.writing():
            # owned by the writing stream, so the caching allocator ties the block to it; the
            # reader's stream is recorded on it at each barrier (buckets())
            self.buf = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
        self._written: Any = None  # event on self.stream: the version's bytes are in
        self._read: Any = None  # event on the reader's stream: the barrier's loads from it are queued before it
        self.version: int | None = None
        self.done = False
        self.error: BaseException | None = None
        self.digests: list[int | None] = []
        self._cond = threading.Condition()

    def writing(self) -> contextlib.AbstractContextManager[Any]:
        """The block in which the ahead work is issued: on the copy's own stream (a device), so
        every copy, digest and collective of it is queued there."""
        return devices.use_stream(self.device, self.stream)

    def begin(self, version: int) -> None:
        with self._cond:
            self.version, self.done, self.error, self.digests = version, False, None, []
            self._written = None
            self._cond.notify_all()
        if self._read is not None:
            # the last barrier's loads may still be queued on the engine's stream, reading the
            # version this one overwrites
            devices.wait_event(self._read, self.stream)

    def bucket(self, b: int, nbytes: int) -> torch.Tensor:
        if nbytes > self.plan.buckets[b].nbytes:
            raise VersionError(f"bucket {b} carries {nbytes} bytes, more than the {self.plan.buckets[b].nbytes} "
                               f"the ahead copy holds for it")
        return self.buf[self.bases[b]: self.bases[b] + nbytes]

    def finish(self, version: int, error: BaseException | None) -> None:
        """The version is in (``error`` None) or failed on the way in."""
        written = devices.record_event(self.device, self.stream) if self.stream is not None else None
        with self._cond:
            if self.version == version:
                self.done, self.error, self._written = True, error, written
                self._cond.notify_all()

    def wait(self, version: int, deadline: Deadline, tick_s: float = 0.2) -> None:
        """Until ``version`` is in; raises what failed it on the way in, VersionError if the
        copy moved past it, or DeadlineExceeded."""
        with self._cond:
            while not (self.version == version and self.done):
                if self.version is not None and self.version > version:
                    raise VersionError(f"version {version} was not received ahead: the ahead copy holds {self.version}")
                now = time.monotonic()
                if now >= deadline.at:
                    raise deadline.expired(f"version {version} did not arrive ahead")
                self._cond.release()
                try:
                    deadline.check()  # the coordinator: aborted already? (outside the lock: it is a call)
                finally:
                    self._cond.acquire()
                if not (self.version == version and self.done):  # a finish() during check() woke no one
                    self._cond.wait(min(tick_s, max(0.0, deadline.at - now)))
            if self.error is not None:
                raise self.error

    def buckets(self, plan: BucketPlan) -> Iterator[Bucket]:
        """The version's buckets as received and verified (``plan``: their wire lengths, as the
        version's record gives them), to be read on the calling thread's current stream: the
        engine's, at the barrier."""
        reader = devices.current_stream(self.device) if self.stream is not None else None
        if reader is not None:
            if self._written is not None:
                devices.wait_event(self._written, reader)  # the loads wait on the device, the host goes on
            devices.record_stream(self.buf, reader)
        try:
            for b, bucket in enumerate(plan.buckets):
                expected = self.digests[b] if b < len(self.digests) else None
                yield Bucket(b, self.bucket(b, bucket.nbytes), expected, "here" if expected is not None else "")
        finally:
            if reader is not None:
                self._read = devices.record_event(self.device, reader)

    def span(self) -> Span:
        """Unpacker's ``span``: buckets sit back to back, so a split tensor is one view."""
        return spans(self.buf, self.bases, self.plan)
