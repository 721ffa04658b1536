"""Internal. Resident-memory high-water marks of the calling process.

Linux lets a process reset its own peak (VmHWM) by writing 5 to /proc/self/clear_refs,
so each benchmark row measures its own peak instead of the process's lifetime peak.
Shared mappings (a /dev/shm segment, Ray's object store) count once they are touched.
"""

from __future__ import annotations

import resource

import psutil

from weightsync.transports.shm.transport import meminfo


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


class NodeShmem:
    """Peak growth of the node's shared memory (``Shmem`` of /proc/meminfo: /dev/shm files,
    Ray's object store) over its value at ``start()``, sampled by a thread every ``interval``
    seconds until ``stop()``. Node-wide: other jobs' segments count too."""

    def __init__(self, interval: float = 0.02):
        import threading

        self.interval = interval
        self.base = meminfo("Shmem")
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-shmem", daemon=True)

    def _sample(self) -> None:
        now = meminfo("Shmem")
        if now is not None and self.peak is not None:
            self.peak = max(self.peak, now)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self) -> NodeShmem:
        if self.base is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self._sample()

    def extra(self) -> int | None:
        return None if self.base is None else max(0, self.peak - self.base)
