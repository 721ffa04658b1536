"""Internal. ``delta: auto``: per version, send a delta or the whole version, from what each took here.

Whether a delta pays depends on the link, not on the bytes alone: over gloo on loopback (2 GB/s)
diffing 1.2 GB on the trainer costs more than the 1.1 GB it saves (docs/delta.md), across a
slower link it is the other way round, and a trainer cannot tell which from its configuration.
So ``auto`` measures: it tries both ways for three versions each, then sends the faster one and
tries the other again every ``retry_every`` versions (the fraction an RL step changes moves with
the learning-rate schedule, the link with the cluster's load).

Three ways to send a version:

- ``DELTA``: diffed against the snapshot of the last committed version (needs that base, held by
  every receiver; otherwise the sender sends ``PRIME``);
- ``PRIME``: whole, written into the snapshot (and every receiver's shadow) as it goes, so the
  next version can be a delta; not timed as "full" (it does the copies a delta needs);
- ``FULL``: whole, without snapshot or shadow: exactly what ``delta: off`` sends.

Pure: no Ray, no clock; the sender reports each version's seconds (stage + barrier).
"""

from __future__ import annotations

import collections
import dataclasses
import statistics

DELTA, PRIME, FULL = "delta", "prime", "full"


@dataclasses.dataclass
class AutoPolicy:
    """The choice between delta and full versions for one sender.

    Args:
        samples: Versions of each way needed before choosing (the median of the last ones
            decides).
        retry_every: Versions sent the chosen way before the other is tried again.
    """

    # three: the median drops one outlier (the first version of a way can pay its set-up, a busy
    # trainer host a stall; measured: 2.3 s and 0.87 s for two full versions in a row)
    samples: int = 3
    retry_every: int = 32
    seconds: dict[str, collections.deque] = dataclasses.field(default_factory=dict)
    chosen: str | None = None
    since_choice: int = 0
    first: bool = True  # the session's first version pays set-up costs: not a sample

    def __post_init__(self) -> None:
        if self.samples < 1 or self.retry_every < 1:
            raise ValueError(f"samples ({self.samples}) and retry_every ({self.retry_every}) must be >= 1")
        self.seconds = {DELTA: collections.deque(maxlen=self.samples), FULL: collections.deque(maxlen=self.samples)}

    def next(self, has_base: bool) -> str:
        """How to send the next version; ``has_base``: the snapshot holds the version every
        receiver serves (a delta is possible)."""
        want = self._want()
        if want == DELTA:
            return DELTA if has_base else PRIME
        return FULL

    def _want(self) -> str:
        if self.first:
            return DELTA  # primes the snapshot: a delta can be tried next
        short = [way for way in (DELTA, FULL) if len(self.seconds[way]) < self.samples]
        if short:
            return short[0]
        if self.chosen is None:
            self.chosen = self._faster()
            self.since_choice = 0
        if self.since_choice >= self.retry_every:
            other = FULL if self.chosen == DELTA else DELTA
            self.seconds[other].clear()  # measure it afresh
            self.chosen = None
            return other
        return self.chosen

    def _faster(self) -> str:
        d, f = (statistics.median(self.seconds[w]) for w in (DELTA, FULL))
        return DELTA if d < f else FULL

    def record(self, way: str, seconds: float, committed: bool) -> None:
        """What a version sent ``way`` cost, stage and barrier together. Failed versions and
        primes are no samples."""
        first, self.first = self.first, False
        if self.chosen is not None:
            self.since_choice += 1
        if first or not committed or way == PRIME:
            return
        if way not in self.seconds:
            raise ValueError(f"unknown way {way!r}: one of {DELTA!r}, {PRIME!r}, {FULL!r}")
        self.seconds[way].append(float(seconds))

    def describe(self) -> dict[str, object]:
        return {"chosen": self.chosen, **{f"{w}_s": list(s) for w, s in self.seconds.items()}}
