"""How fast the torch digest runs on a device, and which way of computing it is fastest there.

    python benchmarks/digest_device.py [--device cuda] [--gib 1.17] [--bucket-mb 256] [--reps 7]
        [--json out.json]

Every way computes the same value (checked here on the device, and in tests/test_digest.py on
CPU); the rows are interleaved per repetition so a clock or neighbour change hits all of them
alike. Reference rows: one device-to-device copy of the same bytes (what a receiver's load
costs at least) and xxh3 after a copy to the host (what the host digest would cost there).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from weightsync import digest as D  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _with(row_sums: Callable | None, chunk_words: int | None, fn: Callable) -> Callable:
    """``fn`` run with the device's row-sum way and step size set for the call."""
    def run(*a):
        saved_rs, saved_chunk = dict(D.ROW_SUMS), D.DEVICE_CHUNK_WORDS
        try:
            if row_sums is not None:
                D.ROW_SUMS["cuda"] = D.ROW_SUMS["npu"] = row_sums
            if chunk_words is not None:
                D.DEVICE_CHUNK_WORDS = chunk_words
            return fn(*a)
        finally:
            D.ROW_SUMS.clear()
            D.ROW_SUMS.update(saved_rs)
            D.DEVICE_CHUNK_WORDS = saved_chunk
    return run


def ways() -> dict[str, Callable | None]:
    found = {"pairs": D._row_sums_pairs, "swap": D._row_sums_swap}
    flat = getattr(D, "_row_sums_flat", None)
    if flat is not None:
        found["flat"] = flat
    return found


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--gib", type=float, default=1.17)
    p.add_argument("--bucket-mb", type=int, default=256)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    device = torch.device(args.device)
    nbytes = int(args.gib * 2**30) // 4 * 4
    bucket = args.bucket_mb << 20
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    buckets = [data[i:i + bucket] for i in range(0, nbytes, bucket)]
    dest = torch.empty_like(data)

    def digest_all() -> list[int]:
        vals = [D.torch_digest(b) for b in buckets]
        return [D.as_int(v) for v in vals]

    rows: dict[str, Callable] = {}
    for name, rs in ways().items():
        for chunk in (1 << 22, 1 << 24):
            rows[f"torch-{name}-{chunk >> 20}Mw"] = _with(rs, chunk, digest_all)
    rows["copy-d2d"] = lambda: dest.copy_(data)
    if nbytes <= 4 << 30:
        rows["xxh3-via-host"] = lambda: [D.xxh3(b) for b in buckets]

    # the same value every way (the reference: the host's computation of the first bucket)
    ref = D.as_int(D.torch_digest(buckets[0].cpu()))
    values = {name: fn()[0] for name, fn in rows.items() if name.startswith("torch-")}
    wrong = {k: f"{v:016x}" for k, v in values.items() if v != ref}
    print(f"reference {ref:016x}; ways that differ: {wrong or 'none'}", flush=True)

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
           "differ": wrong, "rows": {}}
    print(f"{nbytes / 2**30:.2f} GiB in {len(buckets)} buckets of {args.bucket_mb} MiB on {out['name']}")
    for name, ts in times.items():
        q = statistics.quantiles(ts, n=4) if len(ts) > 1 else [ts[0]] * 3
        med = statistics.median(ts)
        out["rows"][name] = {"median_s": med, "iqr_s": q[2] - q[0], "gb_s": nbytes / med / 1e9, "times_s": ts}
        print(f"  {name:24s} median {med * 1e3:8.2f} ms  IQR {(q[2] - q[0]) * 1e3:6.2f} ms  {nbytes / med / 1e9:8.1f} GB/s")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
