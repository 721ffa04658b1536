"""How fast the torch digest runs on a device, against the copy of the same bytes.

    python benchmarks/digest_device.py [--device cuda] [--gib 1.17] [--bucket-mb 256] [--reps 9]
        [--tiles 1024x4 2048x2 ...] [--host] [--json out.json]

Rows: the one-pass kernel (weightsync/digest/kernel.py) with each tile asked for, the torch ops
way (flat row sums, 16 Mi-word steps: the way before the kernel, and the way on NPU), one
device-to-device copy of the same bytes (the floor a receiver's load costs at least), and with
``--host`` xxh3 after a copy to the host. Every digest row must give the same values (checked
here, on every bucket, against the host's computation; tests/test_digest_kernel.py checks the
kernel on CPU); rows are interleaved per repetition, so a clock or neighbour change hits all
of them alike.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from weightsync import digest as D  # noqa: E402
from weightsync.digest import kernel  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _with_env(value: str, fn: Callable) -> Callable:
    """``fn`` run with WEIGHTSYNC_DIGEST_KERNEL set to ``value`` (a tile, or off)."""
    def run(*a):
        saved = os.environ.get(kernel.ENV)
        os.environ[kernel.ENV] = value
        try:
            return fn(*a)
        finally:
            if saved is None:
                os.environ.pop(kernel.ENV, None)
            else:
                os.environ[kernel.ENV] = saved
    return run


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--gib", type=float, default=1.17)
    p.add_argument("--bucket-mb", type=int, default=256)
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--tiles", nargs="*", default=["1024x4", "2048x2", "2048x4", "512x8", "4096x1"])
    p.add_argument("--host", action="store_true", help="also xxh3 after a copy to the host (seconds per rep)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    device = torch.device(args.device)
    nbytes = int(args.gib * 2**30) // 4 * 4
    bucket = args.bucket_mb << 20
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    buckets = [data[i:i + bucket] for i in range(0, nbytes, bucket)]
    dest = torch.empty_like(data)

    def digest_all() -> list[torch.Tensor]:
        return [D.torch_digest(b) for b in buckets]

    rows: dict[str, Callable] = {}
    if kernel.enabled(device) or os.environ.get(kernel.ENV) == "on":
        for tile in args.tiles:
            rows[f"kernel-{tile}"] = _with_env(tile, digest_all)
    rows["torch-ops"] = _with_env("off", digest_all)
    rows["copy-d2d"] = lambda: dest.copy_(data)
    if args.host:
        rows["xxh3-via-host"] = lambda: [D.xxh3(b) for b in buckets]

    # the same value every way, on every bucket (the reference: the host's torch ops way)
    ref = [D.as_int(_with_env("off", D.torch_digest)(b.cpu())) for b in buckets]
    wrong = {}
    for name, fn in rows.items():
        if name.startswith(("kernel-", "torch-")):
            got = [D.as_int(v) for v in fn()]
            if got != ref:
                wrong[name] = [f"{v:016x}" for v in got]
    print(f"reference {ref[0]:016x}...; ways that differ: {sorted(wrong) or 'none'}", flush=True)

    for fn in rows.values():  # compile and warm every row once before timing
        fn()
    times: dict[str, list[float]] = {k: [] for k in rows}
    for _ in range(args.reps):
        for name, fn in rows.items():
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            times[name].append(time.perf_counter() - t0)
    out = {"device": str(device), "name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "bytes": nbytes, "bucket_bytes": bucket, "reps": args.reps,
           "default_tile": f"{kernel.BLOCK}x{kernel.ROWS}", "differ": sorted(wrong), "rows": {}}
    copy = statistics.median(times["copy-d2d"])
    print(f"{nbytes / 2**30:.2f} GiB in {len(buckets)} buckets of {args.bucket_mb} MiB on {out['name']}")
    for name, ts in times.items():
        q = statistics.quantiles(ts, n=4) if len(ts) > 1 else [ts[0]] * 3
        med = statistics.median(ts)
        out["rows"][name] = {"median_s": med, "iqr_s": q[2] - q[0], "gb_s": nbytes / med / 1e9,
                             "x_copy": med / copy, "times_s": ts}
        print(f"  {name:16s} median {med * 1e3:8.3f} ms  IQR {(q[2] - q[0]) * 1e3:6.3f} ms  "
              f"{nbytes / med / 1e9:8.1f} GB/s  {med / copy:6.2f}x the copy")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
