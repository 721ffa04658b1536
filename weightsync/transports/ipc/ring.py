"""The ipc sender's ring for one version (ipc/transport.py): where each bucket is packed,
and when it is published to the receivers. ``sender`` is the IpcSender (not imported: ipc.py
imports this module)."""

from __future__ import annotations

from typing import Any

import torch

from ... import device as devices
from ...digest import as_int, compute
from ...manifest import BucketPlan, BucketSink
from ..memory import wake
from .wire import Watch, ready_word, tag


class Ring(BucketSink):
    """One version packed into the sender's ring: bucket b goes to buffer b % nbuf once every
    receiver released the bucket it held there; a bucket is published (digest, then ready
    word) once its copies have landed. On a device an event per bucket says so (Fences): the
    host queues bucket b's copies while b - 1's are still in flight, and blocks on one only
    when its buffer is needed again."""

    def __init__(self, sender: Any, version: int, watch: Watch, deadline: float, plan: BucketPlan):
        self.plan = plan  # the packing's wire lengths (shorter where its buckets are encoded)
        self.sender, self.version, self.watch, self.deadline = sender, version, watch, deadline
        self.published = self.fenced = -1
        self.asked: set[int] = set()
        self.digests: dict[int, Any] = {}  # from pack_stream, by bucket, until published
        self.sums: list[int] = []
        self.fences = devices.Fences(sender.buffer_device())

    def buffer(self, b: int) -> torch.Tensor:
        # plan order is monotonic: when bucket b is asked for, every bucket before it is full
        # (a tensor split over several buckets would otherwise hold them all unpublished)
        s = self.sender
        self.publish_through(b - 1, block=False)
        self.asked.add(b)
        k = b % s.nbuf
        if b >= s.nbuf:
            self.publish_through(b - s.nbuf)  # receivers release only what they saw published
            # a receiver may be waiting for bucket b - 1 before it releases anything (its own
            # loads land late too): publish every full bucket before waiting on the receivers
            s._wait_released(self.version, b - s.nbuf, k, self.watch, self.deadline,
                             owed=lambda: self.publish_through(b - 1))
        s.control.words[ready_word(k)] = 0  # receivers that outlived their turn see the overwrite
        return s.buffers[k][: self.plan.buckets[b].nbytes]

    def done(self, b: int, digest: int | torch.Tensor | None) -> None:
        if digest is not None:
            self.digests[b] = digest

    def _fence(self, last: int) -> None:
        """Buckets up to ``last`` are fully queued: mark them, their device digests copied behind."""
        if last <= self.fenced:
            return
        while self.fenced < last:
            b = self.fenced + 1
            if b not in self.asked:
                self.fences.mark(b - 1)  # claiming may wait on an earlier bucket: it must be marked
                self.buffer(b)  # never handed out (nothing to write): still claim the buffer
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
        s, w = self.sender, self.sender.control.words
        while self.published < last:
            b = self.published + 1
            if not self.fences.done(b, block):
                return
            k, n = b % s.nbuf, self.plan.buckets[b].nbytes
            if s.digest_kind:
                d = self.digests.pop(b, None)
                self.sums.append(as_int(compute(s.digest_kind, s.buffers[k][:n]) if d is None else d))
                w[ready_word(k) + 1] = self.sums[-1]
            w[ready_word(k)] = tag(self.version, b)
            wake(w, ready_word(k))  # receivers sleeping on the word (transports/memory.py)
            self.published = b
