"""Resident-memory high-water marks of the calling process.

Linux lets a process reset its own peak (VmHWM) by writing 5 to /proc/self/clear_refs,
so each benchmark row measures its own peak instead of the process's lifetime peak.
Shared mappings (a /dev/shm segment, Ray's object store) count once they are touched.
"""

from __future__ import annotations

import resource

import psutil


def rss() -> int:
    return psutil.Process().memory_info().rss


def _hwm() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class PeakTracker:
    """``start()`` then ``extra()``: peak RSS growth over what was resident at the start."""

    def __init__(self) -> None:
        self.base = rss()
        self.resettable = False

    def start(self) -> None:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.resettable = True
        except OSError:
            self.resettable = False  # lifetime peak only: growth may be under-reported
        self.base = rss()

    def extra(self) -> int:
        peak = _hwm()
        if peak is None:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return max(0, max(peak, rss()) - self.base)
