"""How much memory a node can still give a shared-memory segment: /proc/meminfo, the memory
cgroup's room (shmem is charged to it), and the free space of a segment directory. A segment
is checked against this before its pages are reserved, so no room is a CapacityError naming
the figure, not a SIGBUS mid-copy."""

from __future__ import annotations

import os

from ...errors import CapacityError

_UNLIMITED = 1 << 60  # cgroup limits at or above this mean "no limit"


def meminfo(key: str) -> int | None:
    """A /proc/meminfo field in bytes (``MemAvailable``, ``Shmem``), or None (no such field, not Linux)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def memory_available() -> tuple[int, str]:
    """Bytes the kernel can still give a memfd segment, and where that figure comes from:
    MemAvailable, or less where this process's memory cgroup is limited (shmem is charged to it)."""
    best = meminfo("MemAvailable")
    best, where = (meminfo("MemFree") or 0) if best is None else best, "MemAvailable"
    headroom = _cgroup_headroom()
    if headroom is not None and headroom < best:
        best, where = headroom, "the memory cgroup's limit"
    return best, where


def _cgroup_headroom() -> int | None:
    try:
        with open("/proc/self/cgroup", encoding="ascii") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    v2 = next((ln.split("::", 1)[1] for ln in lines if ln.startswith("0::")), None)
    # (limit, usage, stat) files: v2 under its path, v1 at the memory controller's mount
    candidates = [(f"/sys/fs/cgroup{v2}".rstrip("/"), "memory.max", "memory.current", "file", "shmem")] if v2 else []
    candidates.append(("/sys/fs/cgroup/memory", "memory.limit_in_bytes", "memory.usage_in_bytes",
                       "total_cache", "total_shmem"))
    for base, limit_f, usage_f, cache_key, shmem_key in candidates:
        try:
            with open(f"{base}/{limit_f}", encoding="ascii") as fh:
                raw = fh.read().strip()
            limit = _UNLIMITED if raw == "max" else int(raw)
            with open(f"{base}/{usage_f}", encoding="ascii") as fh:
                usage = int(fh.read())
            with open(f"{base}/memory.stat", encoding="ascii") as fh:
                stat = dict(ln.split() for ln in fh if len(ln.split()) == 2)
        except (OSError, ValueError):
            continue
        if limit >= _UNLIMITED:
            return None
        # page cache the cgroup would reclaim counts as free; shmem (in the cache figure) does not
        reclaimable = max(0, int(stat.get(cache_key, 0)) - int(stat.get(shmem_key, 0)))
        return max(0, limit - usage + reclaimable)
    return None


def check_space(directory: str, need: int, what: str, backing: str = "files") -> None:
    if backing == "memfd":
        free, where = memory_available()
        if need > free:
            raise CapacityError(
                f"{what} needs {need / 2**20:.1f} MiB of memory (memfd) but only {free / 2**20:.1f} MiB are "
                f"available ({where}; free memory on the node, or pick another transport)"
            )
        return
    st = os.statvfs(directory)
    free = st.f_bavail * st.f_frsize
    if need > free:
        raise CapacityError(
            f"{what} needs {need / 2**20:.1f} MiB in {directory} but only {free / 2**20:.1f} MiB are free "
            f"(grow /dev/shm, e.g. docker --shm-size, or pick another transport)"
        )
