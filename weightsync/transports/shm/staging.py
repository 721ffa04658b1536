"""Internal. shm on an accelerator node: each bucket is digested on the device at both ends, so the
check covers both PCIe legs and no byte is hashed by the host.

The host's xxh3 of a version of 1.17 GiB took 0.19 s per side on an H100 node, five times the
whole transfer. Here the sender packs bucket b on its device (one of two staging buffers),
digests it there (the torch digest: the one-pass kernel on CUDA), then copies it to its place
in the segment; the bucket is published (digest word, then ready word) once that copy landed,
seen through an event, so the host keeps packing the next bucket meanwhile. A receiver copies
each bucket from the segment into a staging buffer of its own device, digests that copy there
(digest.Checks: compared once, at the end of the version) and loads from it. So what is
verified is what the engine loads, after both copies over the bus.

Two buffers a side, each the size of the largest bucket: one being filled while the other is
copied out (sender) or loaded from (receiver). A receiver checks its own copy; the segment's
verified marks (one receiver hashes for the node) do not apply.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ... import device as devices
from ...digest import as_int
from ...errors import ProtocolError
from ...manifest import BucketPlan
from ...packing import BucketSink, PackViews
from ..base import TransportContext

BUFFERS = 2


def hashes_on_device(ctx: TransportContext, kind: str | None) -> bool:
    """Whether this party digests its shm buckets on its device: torch digests on an accelerator."""
    return kind == "torch" and devices.has_streams(ctx.device)


class DeviceStage:
    """A party's two staging buffers on its device, allocated at the first version."""

    def __init__(self, ctx: TransportContext):
        self.ctx = ctx
        self.nbytes = max([b.nbytes for b in ctx.plan.buckets] + [1])
        self.buffers: list[torch.Tensor] = []
        self.views = PackViews()  # the sender's: where each bucket's tensors go in each buffer

    def buffer(self, b: int, nbytes: int) -> torch.Tensor:
        if not self.buffers:
            devices.set_current(self.ctx.device)
            self.buffers = [torch.empty(self.nbytes, dtype=torch.uint8, device=self.ctx.device)
                            for _ in range(BUFFERS)]
            self.ctx.account("shm_staging_bytes", +BUFFERS * self.nbytes)
        return self.buffers[b % BUFFERS][:nbytes]

    def close(self) -> None:
        self.views.clear()
        if self.buffers:
            self.ctx.account("shm_staging_bytes", -BUFFERS * self.nbytes)
            self.buffers = []


class StagedSink(BucketSink):
    """The sender's: bucket b is packed into staging buffer b % 2 and digested there by
    pack_stream; after ``done`` its copy into the segment (``target(b)``) is queued, when the
    next buffer is asked for (BucketSink's contract: the bucket is final by then), and
    ``publish(b, digest)`` runs once that copy landed, in bucket order."""

    def __init__(self, stage: DeviceStage, plan: BucketPlan, target: Callable[[int], torch.Tensor],
                 publish: Callable[[int, int | None], None]):
        self.stage, self.plan, self.target, self.publish = stage, plan, target, publish
        self.views = stage.views
        self.fences = devices.Fences(stage.ctx.device)
        self.finished: tuple[int, Any] | None = None  # packed and digested, not yet on its way to the host
        self.queued: collections.deque[tuple[int, Any]] = collections.deque()

    def buffer(self, b: int) -> torch.Tensor:
        self.publish_through(b - 1, block=False)
        if b >= BUFFERS:
            self.publish_through(b - BUFFERS)  # its staging buffer is free once that bucket reached the host
        return self.stage.buffer(b, self.plan.buckets[b].nbytes)

    def done(self, b: int, digest: int | torch.Tensor | None) -> None:
        self.finished = (b, digest)

    def _ship(self) -> None:
        if self.finished is None:
            return
        b, digest = self.finished
        self.finished = None
        n = self.plan.buckets[b].nbytes
        self.target(b).copy_(self.stage.buffer(b, n), non_blocking=True)  # pinned segment: asynchronous
        value = self.fences.host_copy(digest) if isinstance(digest, torch.Tensor) else digest
        self.fences.mark(b)
        self.queued.append((b, value))

    def publish_through(self, last: int, block: bool = True) -> None:
        """Publish the buckets up to ``last`` (without ``block``: those landed already)."""
        self._ship()
        while self.queued and self.queued[0][0] <= last:
            b, value = self.queued[0]
            if not self.fences.done(b, block):
                return
            self.queued.popleft()
            self.publish(b, as_int(value) if value is not None else None)


def receive_staged(stage: DeviceStage, plan: BucketPlan, host_view: Callable[[int, int], torch.Tensor],
                   wait_ready: Callable[[int], int | None], still_ready: Callable[[int], bool],
                   version: int) -> Iterator[tuple[int, torch.Tensor, int | None]]:
    """The receiver's: each bucket, once ``wait_ready(b)`` gave its digest, copied from the
    segment (``host_view(b, nbytes)``) into staging buffer b % 2 once the loads out of bucket
    b - 2 landed, and yielded from there. Raises ProtocolError if a bucket was overwritten in
    the segment before its copy landed (``still_ready``)."""
    loaded = devices.Fences(stage.ctx.device)  # the engine's loads out of each staging buffer
    for b, bucket in enumerate(plan.buckets):
        expected = wait_ready(b)
        if b >= BUFFERS:
            loaded.done(b - BUFFERS, block=True)
        dst = stage.buffer(b, bucket.nbytes)
        dst.copy_(host_view(b, bucket.nbytes), non_blocking=True)
        yield b, dst, expected
        loaded.mark(b)
    loaded.done(plan.bucket_count - 1, block=True)  # the copies out of the segment landed with the loads
    for b in range(plan.bucket_count):
        if not still_ready(b):
            raise ProtocolError(f"bucket {b} of version {version} was overwritten while it was loaded")

