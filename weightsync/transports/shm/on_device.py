"""Internal. shm on an accelerator node: each bucket is digested on the device at both ends, so the
check covers both PCIe legs and no byte is hashed by the host.

The host's xxh3 of a version of 1.17 GiB took 0.19 s per side on an H100 node, five times the
whole transfer. Here the sender packs bucket b on its device (one of two device buffers),
digests it there (the torch digest: the one-pass kernel on CUDA), then copies it to its place
in the segment; the bucket is published (digest word, then ready word) once that copy landed,
seen through an event, so the host keeps packing the next bucket meanwhile. A receiver copies
each bucket from the segment into a device buffer of its own device, digests that copy there
(digest.Checks: compared once, at the end of the version) and loads from it. So what is
verified is what the engine loads, after both copies over the bus.

Two buffers a side, each the size of the largest bucket: one being filled while the other is
copied out (sender) or loaded from (receiver). A receiver checks its own copy; the segment's
verified marks (one receiver hashes for the node) do not apply.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import Any

import torch

from ... import device as devices
from ...digest import as_int
from ...manifest import BucketPlan, PackViews
from .. import TransportContext

BUFFERS = 2


class DeviceBuffers:
    """A party's two device buffers on its device, allocated at the first version."""

    def __init__(self, ctx: TransportContext):
        self.ctx = ctx
        self.nbytes = max([b.nbytes for b in ctx.plan.buckets] + [1])
        self.buffers: list[torch.Tensor] = []
        self.views = PackViews()  # the sender's: where each bucket's tensors go in each buffer
        self.generation = 0  # bumped when the buffers go (Bucket.generation)

    def buffer(self, b: int, nbytes: int) -> torch.Tensor:
        if not self.buffers:
            devices.set_current(self.ctx.device)
            self.buffers = [torch.empty(self.nbytes, dtype=torch.uint8, device=self.ctx.device)
                            for _ in range(BUFFERS)]
            self.ctx.account("shm_device_bytes", +BUFFERS * self.nbytes)
        return self.buffers[b % BUFFERS][:nbytes]

    def receiving(self, plan: BucketPlan) -> Iterator[tuple[int, torch.Tensor, devices.Fences]]:
        """The receiver's: (bucket, its device buffer, the fences its loads are marked on), each
        buffer handed out once the loads out of the bucket two before landed; at the end, once
        every load landed (the copies out of the segment land with them)."""
        loaded = devices.Fences(self.ctx.device)  # the engine's loads out of each device buffer
        for b, bucket in enumerate(plan.buckets):
            if b >= BUFFERS:
                loaded.done(b - BUFFERS, block=True)
            yield b, self.buffer(b, bucket.nbytes), loaded
        loaded.done(plan.bucket_count - 1, block=True)

    def close(self) -> None:
        self.views.clear()
        if self.buffers:
            self.ctx.account("shm_device_bytes", -BUFFERS * self.nbytes)
            self.buffers = []
            self.generation += 1


class HostCopies:
    """The sender's: bucket b is packed into device buffer b % 2 (``claim``) and digested there;
    ``done`` queues its copy into the segment; ``landed`` gives the buckets, in order, whose copy
    reached the host, with their digests, to be published."""

    def __init__(self, buffers: DeviceBuffers, plan: BucketPlan):
        self.buffers, self.plan = buffers, plan
        self.fences = devices.Fences(buffers.ctx.device)
        self.queued: collections.deque[tuple[int, Any]] = collections.deque()

    def claim(self, b: int) -> tuple[list[tuple[int, int | None]], torch.Tensor]:
        """Bucket b's device buffer, once the bucket it held before reached the host; and the
        buckets that landed meanwhile, to be published first."""
        ready = self.landed(b - 1, block=False)
        if b >= BUFFERS:
            ready += self.landed(b - BUFFERS)
        return ready, self.buffers.buffer(b, self.plan.buckets[b].nbytes)

    def done(self, b: int, digest: int | torch.Tensor | None, target: torch.Tensor) -> None:
        """Bucket b is packed (and digested): queue its copy to ``target`` in the segment."""
        n = self.plan.buckets[b].nbytes
        target.copy_(self.buffers.buffer(b, n), non_blocking=True)  # pinned segment: asynchronous
        value = self.fences.host_copy(digest) if isinstance(digest, torch.Tensor) else digest
        self.fences.mark(b)
        self.queued.append((b, value))

    def landed(self, last: int, block: bool = True) -> list[tuple[int, int | None]]:
        """The buckets up to ``last`` whose copy landed (``block``: wait for them), in order."""
        out = []
        while self.queued and self.queued[0][0] <= last:
            b, value = self.queued[0]
            if not self.fences.done(b, block):
                break
            self.queued.popleft()
            out.append((b, as_int(value) if value is not None else None))
        return out
