"""Internal. How far a benchmark run is and how long it has left: one overall bar with an ETA across
every row and round (tqdm, on a terminal), and the same estimate in the line each row prints
when it ends (logs and pipes see no bar).

The work is counted in versions moved, the unit every row ticks in (weightsync_bench.interleave
says how many a row moves); rows of one run differ in seconds per version, so the ETA is a
rate over everything done so far, which the interleaved order keeps representative.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from typing import Any

_overall: Any = None  # the run's tqdm bar while one is open
_ticked = 0  # versions ticked so far (bar or not): a row that ends early is topped up to its plan


@contextlib.contextmanager
def overall(total: int, enabled: bool) -> Iterator[None]:
    """The run's bar over ``total`` versions, below which the rows' own bars come and go."""
    global _overall
    if not (enabled and sys.stderr.isatty()):
        yield
        return
    try:
        from tqdm import tqdm
    except ImportError:
        yield
        return
    with tqdm(total=total, desc="weightsync bench", unit="version", file=sys.stderr, position=0,
              dynamic_ncols=True, bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} versions "
                                             "[{elapsed}<{remaining}]") as bar:
        _overall = bar
        try:
            yield
        finally:
            _overall = None


def advance(n: int = 1) -> None:
    global _ticked
    _ticked += n
    if _overall is not None and n > 0:
        _overall.update(n)


def ticked() -> int:
    return _ticked


class Eta:
    """The time left, from the versions done so far and the seconds they took."""

    def __init__(self, total: int):
        self.total, self.done, self.t0 = total, 0, time.monotonic()
        self._begun = False

    def begin(self) -> None:
        """The clock starts at the first row: set-up (Ray, the actors' models, the copy ceiling)
        takes no versions and would inflate the rate."""
        if not self._begun:
            self._begun, self.t0 = True, time.monotonic()

    def add(self, versions: int) -> None:
        self.done += versions

    def left_s(self) -> float | None:
        if not self.done:
            return None
        return (time.monotonic() - self.t0) / self.done * max(0, self.total - self.done)

    def text(self) -> str:
        left = self.left_s()
        return "" if left is None else f" [{self.done}/{self.total} versions, about {_mmss(left)} left]"


def _mmss(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    return f"{m}m{s:02d}s" if m else f"{s}s"
