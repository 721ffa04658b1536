"""Internal. What a transport sees of a delta version: a wire plan and a Packing of encoded buckets.

A delta version keeps the session plan's buckets, in the same order, with their lengths
replaced by the encoded lengths (0 for a skipped bucket, which still passes through the
transport as an empty bucket, so every transport keeps its bucket-indexed bookkeeping). So the
only change in a transport is to take a version's bucket lengths from ``packing.plan``
(sender) and ``plan_of(info)`` (receiver) instead of the session plan: every encoding fits
where the full bucket would (delta.choose never picks a sparse form longer than the bucket).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import torch

from .. import digest as digests
from ..packing import BucketSink, Packing


@dataclasses.dataclass(frozen=True)
class EncodedPacking(Packing):
    """A delta version's encoded buckets for a transport's BucketSink, in plan order;
    ``plan`` is the wire plan (BucketPlan.with_lengths). The payloads are host tensors the sender keeps until the
    version's outcome is known."""

    payloads: tuple[torch.Tensor | None, ...] = ()

    def into(self, sink: BucketSink, kind: str | None) -> Iterator[int]:
        for bucket in self.plan.buckets:
            b, n = bucket.index, bucket.nbytes
            dst = sink.buffer(b)[:n]
            if n:
                dst.copy_(self.payloads[b], non_blocking=False)
            sink.done(b, None if kind is None else digests.compute(kind, dst))
            yield b
