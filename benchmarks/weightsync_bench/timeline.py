"""Internal. A tiny span recorder and a PNG renderer for "who was busy when" pictures.

Spans are (actor, phase, start, end) with wall-clock times from ``time.time()``: the actors
of one example run in different processes on one machine, and only the wall clock is shared
between them. Recording is plain data (picklable, msgpack-able); rendering needs matplotlib
(the ``plot`` extra), imported only when a picture is drawn.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator, Sequence
from typing import Any

# one colour per phase name, so every panel of a figure reads the same way
COLORS = {
    "generate": "#4c72b0",
    "train": "#dd8452",
    "stage": "#55a868",
    "apply": "#c44e52",
    "barrier": "#8172b3",
}
_FALLBACK = ["#937860", "#da8bc3", "#8c8c8c", "#ccb974", "#64b5cd"]


@dataclasses.dataclass(frozen=True)
class Span:
    actor: str
    phase: str
    start: float
    end: float

    @property
    def seconds(self) -> float:
        return self.end - self.start

    def to_wire(self) -> list[Any]:
        return [self.actor, self.phase, self.start, self.end]

    @classmethod
    def from_wire(cls, row: Sequence[Any]) -> Span:
        actor, phase, start, end = row
        return cls(str(actor), str(phase), float(start), float(end))


class Recorder:
    """Collects spans of one actor (or of several, naming each)."""

    def __init__(self, actor: str = ""):
        self.actor = actor
        self.spans: list[Span] = []

    def add(self, phase: str, start: float, end: float, actor: str | None = None) -> Span:
        span = Span(actor or self.actor, phase, start, end)
        self.spans.append(span)
        return span

    @contextlib.contextmanager
    def span(self, phase: str, actor: str | None = None) -> Iterator[None]:
        start = time.time()
        try:
            yield
        finally:
            self.add(phase, start, time.time(), actor)

    def drain(self) -> list[list[Any]]:
        """The spans recorded so far, as wire rows, forgetting them here."""
        rows = [s.to_wire() for s in self.spans]
        self.spans.clear()
        return rows


def busy_seconds(spans: Sequence[Span], actor: str, phase: str | None = None) -> float:
    return sum(s.seconds for s in spans if s.actor == actor and (phase is None or s.phase == phase))


def render_png(panels: Sequence[tuple[str, Sequence[Span], Sequence[float]]], path: str,
               title: str = "", actors: Sequence[str] | None = None) -> str | None:
    """Draw one Gantt panel per (title, spans, step boundaries) on a shared seconds axis.

    Each panel's time starts at its first span; step boundaries are drawn as thin lines.
    Returns why nothing was drawn (matplotlib missing), else None.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        return "matplotlib is not installed (pip install 'weightsync[plot]')"

    order = list(actors) if actors else sorted({s.actor for _, spans, _ in panels for s in spans})
    phases = [p for p in COLORS if any(s.phase == p for _, spans, _ in panels for s in spans)]
    for _, spans, _ in panels:
        for s in spans:
            if s.phase not in phases:
                phases.append(s.phase)
    colors = dict(COLORS)
    for i, phase in enumerate(p for p in phases if p not in COLORS):
        colors[phase] = _FALLBACK[i % len(_FALLBACK)]
    width = max((max(s.end for s in spans) - min(s.start for s in spans) for _, spans, _ in panels if spans),
                default=1.0)

    fig, axes = plt.subplots(len(panels), 1, figsize=(13, 1.0 + 1.6 * len(panels) * max(1, len(order)) / 3),
                             sharex=True, squeeze=False)
    for ax, (name, spans, steps) in zip(axes[:, 0], panels, strict=True):
        t0 = min((s.start for s in spans), default=0.0)
        for row, actor in enumerate(order):
            mine = [s for s in spans if s.actor == actor]
            for phase in phases:
                bars = [(s.start - t0, s.seconds) for s in mine if s.phase == phase]
                if bars:
                    ax.broken_barh(bars, (row - 0.38, 0.76), facecolors=colors[phase], edgecolor="white",
                                   linewidth=0.4)
        for boundary in steps:
            ax.axvline(boundary - t0, color="#333333", linewidth=0.6, linestyle=":")
        ax.set_yticks(range(len(order)), order)
        ax.set_ylim(len(order) - 0.5, -0.5)
        ax.set_xlim(0, width * 1.01)
        ax.set_title(name, loc="left", fontsize=10)
        ax.grid(axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel("seconds (dotted lines: end of each step)")
    fig.legend(handles=[Patch(color=colors[p], label=p) for p in phases], loc="upper right", ncol=len(phases),
               fontsize=9, frameon=False)
    if title:
        fig.suptitle(title, x=0.01, ha="left", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
