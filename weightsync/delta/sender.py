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

import torch

from .. import digest
from ..manifest import BucketPlan, Manifest, NamedTensors, Packer, PackViews
from ..records import DeltaRecord
from . import codec as delta
from .policy import DELTA, FULL, PRIME, AutoPolicy

log = logging.getLogger("weightsync")

# transports that move bytes at memory speed: the host work of a delta (diff at the trainer,
# apply and hash at each receiver) costs more than the bytes it saves there (measured with
# benchmarks/delta_probe.py: shm 0.72 s full vs 2.7 s delta for 1.2 GB at 1 % changed)
MEMORY_SPEED = frozenset({"shm", "ipc"})


def wanted(mode: str, transport: str) -> bool:
    """Whether a session runs delta sync: ``on`` always, ``auto`` except on memory-speed
    transports (there it is ``off``: no snapshot, no shadow), ``off`` never."""
    return mode == "on" or (mode == "auto" and transport not in MEMORY_SPEED)


def host_reserve(mode: str, transport: str, plan: BucketPlan) -> int:
    """Host bytes the sender keeps on its node beside ``transport``'s buffers for config
    ``delta: mode``: the snapshot where the session runs delta sync, else 0."""
    return delta.snapshot_bytes(plan.bucket_count, plan.bucket_bytes) if wanted(mode, transport) else 0


class EncodedPacker:
    """A delta version's encoded buckets, handed to a transport as a Packer hands tensors:
    ``plan`` is the wire plan (BucketPlan.with_lengths), ``fill`` copies bucket b's encoding.
    The payloads are host tensors the sender keeps until the version's outcome is known.

    A delta version keeps the session plan's buckets, in the same order, with their lengths
    replaced by the encoded lengths (0 for a skipped bucket, which still passes through the
    transport as an empty bucket), so a transport only takes a version's bucket lengths from
    ``packer.plan`` (sender) and ``record.moves(plan)`` (receiver): every encoding fits where
    the full bucket would (delta.choose never picks a sparse form longer than the bucket)."""

    def __init__(self, plan: BucketPlan, payloads: tuple[torch.Tensor | None, ...]):
        self.plan, self.payloads = plan, payloads
        self.done = False

    def fill(self, b: int, dst: torch.Tensor, kind: str | None = None,
             views: PackViews | None = None) -> int | torch.Tensor | None:
        n = self.plan.buckets[b].nbytes
        dst = dst[:n]
        if n:
            dst.copy_(self.payloads[b], non_blocking=False)
        self.done = b == self.plan.bucket_count - 1
        return None if kind is None else digest.compute(kind, dst)

    def drain(self) -> None:
        self.done = True  # nothing to walk: the tensors were read in stage()


@dataclasses.dataclass
class _Pending:
    version: int
    kinds: list[str]
    payloads: list[torch.Tensor | None]
    lost_base: bool  # a full bucket overwrote the base
    way: str = PRIME  # delta_policy: DELTA, PRIME or FULL


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
                serving: list[int | None]) -> tuple[EncodedPacker, DeltaRecord, str]:
        """Pack ``version`` into the snapshot and encode it; (the packer for the transport, its
        delta record, the whole version's xxh3 digest). ``serving``: what each receiver serves."""
        if self.pending is not None:
            # the previous version's outcome is not known yet: the snapshot is no base
            self.pending, self.base = None, None
        self._write_committed()
        base = self.base is not None and bool(serving) and all(s == self.base for s in serving)
        n = self.plan.bucket_count
        kinds: list[str] = [delta.FULL] * n
        payloads: list[torch.Tensor | None] = [None] * n
        digests: list[int] = [0] * n
        lost_base = not base
        packer, views = Packer(self.plan, self.manifest, named), PackViews()
        try:
            for b in range(n):
                # each bucket lands in one scratch buffer (its alignment gaps zeroed: the diff and
                # the digest depend on the tensors only) and is diffed against the snapshot; a
                # full bucket is written into the snapshot there and then
                new = self.scratch[: self.plan.buckets[b].nbytes]
                digests[b] = int(packer.fill(b, new, "xxh3", views))
                snap = self.bucket(b)
                if not base:
                    snap.copy_(new)
                    payloads[b] = snap
                    continue
                kinds[b], payloads[b] = delta.diff(snap, new)
                lost_base |= kinds[b] == delta.FULL
        except BaseException:
            if lost_base:
                self.base = None
            raise
        lengths = [0 if k == delta.SKIP else int(p.numel()) for k, p in zip(kinds, payloads)]
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
        record = DeltaRecord(base=None if full else self.base, kinds=kinds, lengths=lengths, digests=digests)
        self.last = {"delta_bytes": sum(lengths), "payload_bytes": self.plan.payload_bytes,
                     "delta_buckets": sum(k != delta.FULL for k in kinds)}
        return EncodedPacker(self.plan.with_lengths(lengths), tuple(payloads)), record, digest.version_digest("xxh3", digests)

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
