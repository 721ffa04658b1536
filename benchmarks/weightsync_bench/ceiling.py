"""Internal. The copy ceiling: how fast this machine can copy the payload's bytes at all.

Every transport must at least read and write each byte once, so the fastest copy between
two preallocated buffers, using every core, is the bar a sync is measured against. We take
the best of several copy methods and several repeats: the ceiling is what the hardware can
do, not what one library happens to do.
"""

from __future__ import annotations

import concurrent.futures
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from weightsync import device as devices


def _best(fn: Callable[[], None], repeats: int, sync: Callable[[], None] = lambda: None) -> float:
    fn()  # first touch: page faults and lazy allocation are not copy bandwidth
    sync()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def _threaded_numpy(src: np.ndarray, dst: np.ndarray, threads: int) -> Callable[[], None]:
    # np.copyto releases the GIL for plain byte copies, so one chunk per core runs in parallel
    n = src.size
    step = -(-n // threads)
    cuts = [(i, min(i + step, n)) for i in range(0, n, step)]
    pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="ceiling")

    def run() -> None:
        list(pool.map(lambda c: np.copyto(dst[c[0]:c[1]], src[c[0]:c[1]]), cuts))

    run.pool = pool  # type: ignore[attr-defined]
    return run


def host_ceiling(nbytes: int, repeats: int = 5, threads: int | None = None) -> dict[str, Any]:
    """Best host-to-host copy of ``nbytes`` between two preallocated buffers."""
    threads = threads or os.cpu_count() or 1
    src = torch.empty(nbytes, dtype=torch.uint8)
    dst = torch.empty(nbytes, dtype=torch.uint8)
    src.fill_(7)
    dst.fill_(0)  # both buffers resident before timing
    old_threads = torch.get_num_threads()
    methods: dict[str, float] = {}
    try:
        torch.set_num_threads(threads)
        methods["torch.copy_"] = _best(lambda: dst.copy_(src), repeats)
        a, b = src.numpy(), dst.numpy()
        methods["numpy.copyto"] = _best(lambda: np.copyto(b, a), repeats)
        if threads > 1:
            run = _threaded_numpy(a, b, threads)
            try:
                methods[f"numpy.copyto x{threads} threads"] = _best(run, repeats)
            finally:
                run.pool.shutdown()
    finally:
        torch.set_num_threads(old_threads)
    best = min(methods, key=methods.get)
    return {
        "kind": "host-to-host", "bytes": nbytes, "threads": threads, "repeats": repeats,
        "method": best, "seconds": methods[best], "gbps": nbytes / methods[best] / 1e9,
        "methods_gbps": {k: nbytes / s / 1e9 for k, s in methods.items()},
    }


def device_ceilings(nbytes: int, device: torch.device, repeats: int = 5) -> dict[str, Any]:
    """Device-to-device and (pinned) host-to-device copies on an accelerator."""
    if device.type == "cpu":
        return {}
    sync = lambda: devices.synchronize_device(device)  # noqa: E731
    out: dict[str, Any] = {}
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty(nbytes, dtype=torch.uint8, device=device)
    s = _best(lambda: b.copy_(a), repeats, sync)
    out["device-to-device"] = {"seconds": s, "gbps": nbytes / s / 1e9}
    b.resize_(0)  # give the second device buffer back before the pinned host one is made
    try:
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    except RuntimeError:
        host = torch.empty(nbytes, dtype=torch.uint8)
    host.fill_(1)
    s = _best(lambda: a.copy_(host, non_blocking=True), repeats, sync)
    out["host-to-device"] = {"seconds": s, "gbps": nbytes / s / 1e9, "pinned": host.is_pinned()}
    return out
