"""Internal. Drives the collective broadcast baselines of :mod:`weightsync_bench.collective_baselines` for the
benchmark. Those functions start their own group of Ray actors (sender rank 0 + N receivers,
the broadcast transport's group construction) over the same layout and device; each
baseline row says why when it cannot run here."""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import psutil

from weightsync.device import backend_for, ray_options

# per baseline: the function of weightsync_bench.collective_baselines and whether it checks the bytes
# bcast-flat-load is the fair wire baseline of the broadcast transport: one flat broadcast and
# the load into the model (what our broadcast also does), only without packing or digests
FUNCTIONS = {"bcast-per-tensor": ("per_tensor_broadcast", True), "bcast-flat": ("raw_broadcast", False),
             "bcast-flat-load": ("raw_broadcast_load", True)}


def _module():
    try:
        from . import collective_baselines

        return collective_baselines, None
    except ImportError as exc:
        return None, f"weightsync_bench.collective_baselines is not part of this build ({exc})"


def unavailable(kind: str, backend: str, device: str, payload: int, receivers: int, made: bool = False) -> str | None:
    """Why the baseline cannot run here, or None. ``made``: its group was kept from an earlier
    round (run's ``keep``), so its memory is in use already and is not asked for again."""
    mod, why = _module()
    if mod is None:
        return why
    fn = FUNCTIONS[kind][0]
    if not hasattr(mod, fn):
        return f"weightsync_bench.collective_baselines has no {fn}()"
    want = backend_for(device)
    if backend != want and not (backend == "gloo" and device == "cpu"):
        return f"backend {backend} does not match device {device} (expected {want})"
    if device == "cpu" and not made:
        # these actors hold their own copies: the sender's tensors plus a flat buffer, and per
        # receiver a model plus a flat buffer, beside the benchmark's actors
        need = 2 * payload * (receivers + 1)
        free = psutil.virtual_memory().available
        # margin: the benchmark's own actors sit idle meanwhile (their models are already counted
        # in what is used), but the machine is shared: leave a quarter of what is free, >= 1 GiB
        reserve = max(2**30, free // 4)
        if need + reserve > free:
            return (f"needs about {need / 2**30:.1f} GiB and {reserve / 2**30:.1f} GiB to spare; "
                    f"{free / 2**30:.1f} GiB available")
    return None


def run(manifest: Any, kind: str, receivers: int, backend: str, device: str, repeats: int,
        cpu: dict | None = None, keep: dict | None = None) -> tuple[list[float], bool | None]:
    """(seconds per repetition, bytes verified or None) of one collective baseline; ``cpu``
    gets ``cpu_s``, the CPU seconds its actors spent over the repetitions; ``keep``: where its
    group of actors stays for the next round (collective_baselines._baseline)."""
    mod, why = _module()
    if mod is None:
        raise RuntimeError(why)
    fn, verifies = FUNCTIONS[kind]
    # a device collective takes one whole device per rank (the runner checked there are enough)
    resources = ray_options(device, 1) or None
    seconds = getattr(mod, fn)(manifest, receivers, backend=backend, device=device, repeats=repeats,
                               resources=resources, cpu=cpu, keep=keep)
    # per_tensor_broadcast raises when a receiver's model differs from the sender's tensors
    return list(seconds), (True if verifies else None)


# the Peer method each baseline times (collective_baselines keys kept groups by it)
METHODS = {"bcast-per-tensor": "per_tensor", "bcast-flat": "raw", "bcast-flat-load": "raw_load"}


def made(keep: dict, kind: str, receivers: int) -> bool:
    """Whether ``keep`` holds this baseline's group from an earlier round."""
    return any(k[0] == METHODS[kind] and k[1] == receivers for k in keep)


def start(keep: dict, manifest: Any, kind: str, receivers: int, backend: str, device: str) -> threading.Thread:
    """Make this baseline's group into ``keep`` in a thread, so that its actors start and make
    their version while the bench's own actors make their models (join it before any timing).
    A group that fails here is simply absent: its row makes one and reports what goes wrong."""
    mod, _ = _module()

    def make() -> None:
        with contextlib.suppress(Exception):
            mod.open_kept(keep, METHODS[kind], manifest, receivers, backend, device, ray_options(device, 1) or None)

    thread = threading.Thread(target=make, name=f"weightsync-bench-{kind}", daemon=True)
    thread.start()
    return thread


def close(keep: dict) -> None:
    mod, _ = _module()
    if mod is not None:
        mod.close_kept(keep)


def row(bench: Any, kind: str, receivers: int, backend: str) -> dict[str, Any]:
    """``bcast-per-tensor`` / ``bcast-flat`` from weightsync_bench.collective_baselines: its own
    group of actors (same layout, device and receiver count), made in its first round and kept
    for the others, as the bench's own actors are; peak memory is not tracked."""
    from .interrupt import tick
    from .rowkit import describe_error, devices_short, one_device_per_rank

    row = bench._row(kind="baseline", name=kind, receivers=receivers, backend=backend)
    kept = made(bench._groups, kind, receivers)
    why = unavailable(kind, backend, bench.device, bench.payload, receivers, kept) or (
        devices_short(bench.device, backend, receivers + 1) if one_device_per_rank(backend, bench.device) and not kept
        else None)
    if why:
        row.update(kind="unavailable", error=why)
        return row
    seconds: list[float] = []
    try:
        cpu: dict[str, float] = {}  # its actors' CPU seconds over every repetition
        with bench.progress.bar(1, f"{kind} x{receivers} ({bench.warmup + bench.versions} versions)") as bar:
            timed, verified = run(bench.manifest, kind, receivers, backend, bench.device, bench.warmup + bench.versions,
                                  cpu, bench._groups if "groups" in bench.keep_baselines else None)
            tick(bar, bench.warmup + bench.versions)
        row["parties_cpu_s"] = cpu.get("cpu_s")
        seconds = timed[bench.warmup:]  # the first ones fault in the engine's pages
        row["verified"] = verified
    except Exception as exc:
        row["error"] = describe_error(exc)
    return bench._finish(row, seconds)
