"""Internal. Trainer side of delta sync: a host snapshot of the last committed version, and each new
version diffed against it bucket by bucket (delta/codec.py).

Memory: the snapshot holds every bucket at ``bucket_bytes`` stride (``bucket_count x
bucket_bytes``, the payload plus the plan's padding), plus one scratch bucket, plus per version
the sparse encodings (as large as the delta). Full buckets are sent straight from the
snapshot, so a full version costs no second copy.

Only the outcome of ``sync()`` says whether a version became the committed one, so the
snapshot keeps the last committed version while a version is out: its sparse encodings are
written into the snapshot when it commits (before the next version is diffed), and a failed
one leaves nothing to undo. A full bucket is written over the base as it is staged (keeping
the old bytes would be a second copy of the model): a failed version that wrote one leaves no
base, and the next version goes full.

A version goes as a delta only when every receiver the coordinator knows serves the
snapshot's version; otherwise (a receiver that missed a version, a late joiner, a restarted
one) it goes full, which every receiver applies whatever it held.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
from collections.abc import Iterable, Mapping

import torch

from ..digest import version_digest
from ..manifest import BucketPlan, Manifest
from ..packing import BucketSink, pack_stream
from ..transports.base import DeltaRecord
from . import codec as delta
from .packing import EncodedPacking
from .policy import DELTA, FULL, PRIME, AutoPolicy

log = logging.getLogger("weightsync")

NamedTensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


@dataclasses.dataclass
class _Pending:
    version: int
    kinds: list[str]
    payloads: list[torch.Tensor | None]
    lost_base: bool  # a full bucket overwrote the base
    way: str = PRIME  # delta_policy: DELTA, PRIME or FULL


class _Diff(BucketSink):
    """pack_stream's sink: each bucket lands in one scratch buffer and is diffed against the
    snapshot when complete (a full bucket is written into the snapshot there and then)."""

    def __init__(self, owner: DeltaSender, base: bool):
        self.owner, self.base = owner, base
        n = owner.plan.bucket_count
        self.kinds: list[str] = [delta.FULL] * n
        self.payloads: list[torch.Tensor | None] = [None] * n
        self.digests: list[int] = [0] * n
        self.lost_base = False

    def buffer(self, b: int) -> torch.Tensor:
        # pack_stream zeroes the alignment gaps (the previous bucket's bytes): the diff and the
        # digest depend on the tensors only
        return self.owner.scratch[: self.owner.plan.buckets[b].nbytes]

    def done(self, b: int, digest: int | torch.Tensor | None) -> None:
        new = self.owner.scratch[: self.owner.plan.buckets[b].nbytes]
        snap = self.owner.bucket(b)
        self.digests[b] = int(digest)
        if not self.base:
            snap.copy_(new)
            self.payloads[b] = snap
            return
        self.kinds[b], self.payloads[b] = delta.diff(snap, new)
        self.lost_base |= self.kinds[b] == delta.FULL


def _median(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f}" if xs else "-"


class DeltaSender:
    """The snapshot and the per-version diff of one session's sender (rank 0).

    Args:
        plan: The session's bucket plan.
        manifest: The session's manifest.
        mode: ``auto`` or ``on`` (config ``delta``).
    """

    def __init__(self, plan: BucketPlan, manifest: Manifest, mode: str):
        self.plan, self.manifest, self.mode = plan, manifest, mode
        self.snapshot = torch.empty(plan.bucket_count * plan.bucket_bytes, dtype=torch.uint8)
        self.scratch = torch.empty(plan.bucket_bytes, dtype=torch.uint8)
        self.base: int | None = None  # the committed version the snapshot holds
        self.pending: _Pending | None = None
        self.unwritten: _Pending | None = None  # committed, its sparse buckets not yet in the snapshot
        self.last: dict[str, int] = {}  # the last prepared version's sizes, for metrics
        self.policy = AutoPolicy() if mode == "auto" else None  # "on": a delta whenever there is a base

    @staticmethod
    def memory_bytes(plan: BucketPlan) -> int:
        """Host bytes the trainer keeps for delta sync, besides the per-version deltas."""
        return delta.snapshot_bytes(plan.bucket_count, plan.bucket_bytes)

    def bucket(self, b: int) -> torch.Tensor:
        start = b * self.plan.bucket_bytes
        return self.snapshot[start: start + self.plan.buckets[b].nbytes]

    def way(self, serving: list[int | None]) -> str:
        """How the next version goes (delta_policy): DELTA, PRIME or, with ``auto``, FULL.
        ``serving``: what each receiver serves."""
        has_base = (self.pending is None and self.base is not None and bool(serving)
                    and all(s == self.base for s in serving))
        if self.policy is None:
            return DELTA if has_base else PRIME
        before = self.policy.chosen
        way = self.policy.next(has_base)
        if self.policy.chosen is not None and self.policy.chosen != before:
            d = self.policy.describe()
            log.info("weightsync delta auto: sending %s versions (median s: delta %s, full %s); "
                     "the other way is timed again in %d versions", self.policy.chosen,
                     _median(d["delta_s"]), _median(d["full_s"]), self.policy.retry_every)
        return way

    def skip(self, version: int) -> None:
        """``version`` goes whole, past the snapshot (``auto`` chose FULL): the snapshot is no
        base after it, and the receivers' shadows are no base either."""
        self.pending, self.unwritten, self.base = _Pending(version, [], [], True, FULL), None, None

    def prepare(self, version: int, named: NamedTensors,
                serving: list[int | None]) -> tuple[EncodedPacking, DeltaRecord, str]:
        """Pack ``version`` into the snapshot and encode it; (the packing for the transport, its
        delta record, the whole version's xxh3 digest). ``serving``: what each receiver serves."""
        if self.pending is not None:
            # the previous version's outcome is not known yet: the snapshot is no base
            self.pending, self.base = None, None
        self._write_committed()
        base = self.base is not None and bool(serving) and all(s == self.base for s in serving)
        sink = _Diff(self, base)
        try:
            for _ in pack_stream(self.plan, self.manifest, named, sink, "xxh3"):
                pass
        except BaseException:
            if sink.lost_base or not base:
                self.base = None
            raise
        kinds, payloads = sink.kinds, sink.payloads
        lengths = [0 if k == delta.SKIP else int(p.numel()) for k, p in zip(kinds, payloads)]
        lost_base = sink.lost_base or not base
        if base and not delta.pays(sum(lengths), self.plan.payload_bytes, self.mode):
            # auto: the delta would not pay; the snapshot becomes the new version, sent whole
            self.unwritten = _Pending(version, kinds, payloads, True)
            self._write_committed()
            kinds = [delta.FULL] * self.plan.bucket_count
            payloads = [self.bucket(b) for b in range(self.plan.bucket_count)]
            lengths = [b.nbytes for b in self.plan.buckets]
            lost_base = True
        full = all(k == delta.FULL for k in kinds)
        self.pending = _Pending(version, kinds, payloads, lost_base, PRIME if full else DELTA)
        record = DeltaRecord(base=None if full else self.base, kinds=kinds, lengths=lengths, digests=sink.digests)
        self.last = {"delta_bytes": sum(lengths), "payload_bytes": self.plan.payload_bytes,
                     "delta_buckets": sum(k != delta.FULL for k in kinds)}
        packing = EncodedPacking(self.plan.with_lengths(lengths), self.manifest, (), tuple(payloads))
        return packing, record, version_digest("xxh3", sink.digests)

    def resolved(self, version: int, committed: bool, seconds: float | None = None) -> None:
        """``version``'s sync() returned (``committed``, after ``seconds`` of stage and barrier)
        or raised: the snapshot becomes the base (its sparse buckets written before the next
        diff), or stays the last committed version (none, if a full bucket overwrote it)."""
        p = self.pending
        if p is None or p.version != version:
            return  # superseded by a later prepare(), which dropped the base
        self.pending = None
        if self.policy is not None and seconds is not None:
            self.policy.record(p.way, seconds, committed)
        if p.way == FULL:
            self.base = None
        elif committed:
            self.base, self.unwritten = version, p
        elif p.lost_base:
            self.base = None

    def _write_committed(self) -> None:
        p, self.unwritten = self.unwritten, None
        if p is None:
            return
        for b, (kind, payload) in enumerate(zip(p.kinds, p.payloads)):
            if kind == delta.SPARSE:
                delta.apply(self.bucket(b), kind, payload, f"snapshot bucket {b}", keep_undo=False)
