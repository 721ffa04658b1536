"""Internal. Rollout side of delta sync: a host shadow of the served version that each delta version is
applied to in place, bucket by bucket (delta/codec.py).

Per bucket: the received encoding is applied to the shadow (keeping an undo record), the
rebuilt bucket's xxh3 must equal the sender's digest of the full bucket (DeltaRecord.digests),
else the version fails naming this receiver and the bucket; then the tensors of the bucket are
handed to ``load_weights`` as views of the shadow (a tensor split over buckets once its last
bucket is in: the shadow lays buckets at ``bucket_bytes`` stride, so it lies there whole).
Tensors only in skipped buckets are not loaded: the model holds them already.

On a failure the undo records restore the shadow and the tensors loaded so far are loaded
again from it: rollback on every transport. A full version (no base) keeps no undo records (a
second copy of the model): when one fails, this receiver serves nothing until the next version.
A rebuilt bucket that differs from the sender's is the exception: the shadow itself is no
longer the base (a bit flip, a stray write, a misapplied delta), so undoing the version would
only bring back the bad bytes and reloading them would put them in the model. Nothing is
reloaded; the shadow is dropped as a base and the receiver serves no version, so the sender's
next version goes full (it sends a delta only when every receiver serves its base).

Memory: the shadow, ``bucket_count x bucket_bytes`` of host memory (the payload plus the
plan's padding), allocated at the first delta-mode version, plus the undo records of the
version being applied (as large as its delta).
"""

from __future__ import annotations

import dataclasses

import torch

from ..digest import xxh3
from ..manifest import BucketPlan, Manifest, Unpacker
from ..records import DeltaRecord
from . import codec as delta

Pairs = list[tuple[str, torch.Tensor]]


@dataclasses.dataclass(frozen=True)
class Undone:
    """What undoing a failed version left: the version the shadow holds again (None: none), the
    tensors to load again from it (views of the shadow, per bucket), and why, for the report."""

    version: int | None
    reload: list[Pairs]
    why: str


class DeltaReceiver:
    """One receiver's shadow of the version it serves (``version``: None when none).

    Args:
        plan: The session's bucket plan.
        manifest: The session's manifest.
        name: The receiver's name, for errors.
    """

    def __init__(self, plan: BucketPlan, manifest: Manifest, name: str):
        self.plan, self.name = plan, name
        self.unpacker = Unpacker(plan, manifest)
        self._index = manifest.index()
        self.shadow = torch.empty(plan.bucket_count * plan.bucket_bytes, dtype=torch.uint8)
        self.version: int | None = None
        self._undo: list[tuple[int, delta.Undo | None]] = []
        self._keep_undo = False
        self._active = False  # a version is being applied to the shadow
        self._touched: set[int] = set()
        self.diverged = False  # a rebuilt bucket of the version being applied differed from the sender's

    @staticmethod
    def memory_bytes(plan: BucketPlan) -> int:
        """Host bytes a receiver keeps for delta sync, besides a version's undo records."""
        return plan.bucket_count * plan.bucket_bytes

    def bucket(self, b: int) -> torch.Tensor:
        start = b * self.plan.bucket_bytes
        return self.shadow[start: start + self.plan.buckets[b].nbytes]

    def span(self, b: int, offset: int, nbytes: int) -> torch.Tensor:
        start = b * self.plan.bucket_bytes + offset
        return self.shadow[start: start + nbytes]

    def begin(self, version: int, record: DeltaRecord) -> None:
        """Refuse a delta whose base this receiver does not hold, before any byte moves."""
        if record.base is not None and record.base != self.version:
            held = "no version" if self.version is None else f"version {self.version}"
            raise delta.DeltaError(
                f"receiver '{self.name}' holds {held}, but version {version} is a delta against version "
                f"{record.base}: it needs a full version (the sender sends one when every receiver it knows "
                f"serves its base; this receiver joined or fell behind after the version was staged)")
        self._undo, self._keep_undo = [], record.base is not None
        self._touched = {s.tensor for b, k in zip(self.plan.buckets, record.kinds) if k != delta.SKIP
                         for s in b.slices}
        self.version, self._active, self.diverged = None, True, False  # a mix until the version commits

    def apply(self, version: int, record: DeltaRecord, b: int, buf: torch.Tensor) -> tuple[list, int]:
        """Apply bucket ``b``'s encoding; (the (name, tensor) pairs to load, the rebuilt
        bucket's digest). Raises DeltaError naming this receiver and the bucket."""
        where = f"receiver '{self.name}': bucket {b} of version {version}"
        shadow = self.bucket(b)
        undo = delta.apply(shadow, record.kinds[b], buf.cpu() if buf.numel() else None, where, self._keep_undo)
        if self._keep_undo:
            self._undo.append((b, undo))
        got = xxh3(shadow)
        if got != record.digests[b]:
            self.diverged = True
            raise delta.DeltaError(f"{where}: the rebuilt bucket differs from the sender's (xxh3 {got:016x}, "
                                   f"sender {record.digests[b]:016x}): a lost, reordered or misapplied delta")
        pairs = self.unpacker.unpack(b, shadow, self.span)
        return [(n, t) for n, t in pairs if self._index[n] in self._touched], got

    def committed(self, version: int | None) -> None:
        self.version, self._undo, self._active = version, [], False

    def failed(self, prev: int | None) -> Undone | None:
        """Put the shadow back to ``prev``; the tensors the failed version touched, to be loaded
        again from it where a bucket of the version reached the model. A shadow that diverged
        is no base: nothing is put back nor reloaded, and ``version`` becomes None. None: the
        version was refused before the shadow changed."""
        if not self._active:
            return None
        self._active = False
        if self.diverged:
            self.version, self._undo = None, []
            return Undone(None, [], "; the delta shadow differs from the sender's: serves no version until a full one")
        if not self._keep_undo:
            self.version, self._undo = None, []
            return Undone(None, [], "; serves no version until the next sync (a failed full version keeps no undo "
                                    "records)")
        for b, undo in reversed(self._undo):
            delta.revert(self.bucket(b), undo)
        self._undo = []
        self.version = prev
        reload = []
        for b in range(self.plan.bucket_count):
            pairs = [(n, t) for n, t in self.unpacker.unpack(b, self.bucket(b), self.span) if self._index[n] in self._touched]
            if pairs:
                reload.append(pairs)
        return Undone(prev, reload, f"; rolled back to version {prev} from the delta shadow")
