"""``weightsync bench``: arguments and the run from start to report."""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import socket
import sys
import time
from typing import Any

from ..config import SyncConfig
from ..device import backend_for
from ..layouts import LAYOUTS
from .expect import KEYS, evaluate, fastest, parse_expectation

TRANSPORTS = ("shm", "ipc", "broadcast", "auto")
BASELINE_CHOICES = ("ray-user", "ray-numpy", "bcast-per-tensor", "bcast-flat")


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    p.add_argument("--model", default="qwen2.5-0.5b",
                   help=f"built-in layout ({', '.join(LAYOUTS)}) or a safetensors file/folder")
    p.add_argument("--real-weights", action="store_true",
                   help="with --model PATH: send the file's tensors instead of random bits")
    p.add_argument("--dtype", default=None, help="dtype of a built-in layout (default bfloat16), or the "
                   "floating-point dtype a safetensors layout is cast to")
    p.add_argument("--transport", nargs="+", default=["shm", "ipc", "broadcast"], choices=TRANSPORTS,
                   metavar="T", help=f"one or several of {', '.join(TRANSPORTS)}")
    p.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl", "hccl"),
                   help="collective backend of broadcast (and the collective baselines)")
    p.add_argument("--receivers", nargs="+", type=int, default=[1], metavar="N", help="receiver counts to run")
    p.add_argument("--bucket-mb", nargs="+", type=float, default=[SyncConfig().bucket_mb], metavar="MB",
                   help="bucket sizes to sweep")
    p.add_argument("--checksum", nargs="+", default=["on"], choices=("on", "off"),
                   help="per-bucket digest on or off (the config's checksum), on every transport, device "
                        "links included; both 'on off' shows what it costs")
    p.add_argument("--digest", default="auto", choices=("auto", "xxh3", "torch"),
                   help="digest kind when on: auto = xxh3 for host buckets, torch ops on device buckets")
    p.add_argument("--versions", type=int, default=5, help="timed versions per row")
    p.add_argument("--warmup", type=int, default=2, help="untimed versions first: they allocate the transport's reusable buffers (shm alternates two segments) and fault their pages in")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda", "npu"),
                   help="where trainer tensors and engine weights live")
    p.add_argument("--baselines", nargs="*", default=list(BASELINE_CHOICES), choices=BASELINE_CHOICES, metavar="B",
                   help=f"baselines to run, any of {', '.join(BASELINE_CHOICES)} (none: no baselines)")
    p.add_argument("--ceiling-repeats", type=int, default=5, help="repeats of each copy for the ceiling")
    p.add_argument("--object-store-gb", type=float, default=None,
                   help="Ray object store size (default: enough for the baselines)")
    p.add_argument("--address", default=None, help="Ray cluster to join (default: start a local one)")
    p.add_argument("--no-verify", action="store_true", help="skip the bit-exact check after each row")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--note", default="", help="free text stored in the JSON (e.g. 'machine shared')")
    p.add_argument("--expect", action="append", default=[], type=_expectation, metavar="KEY>=VALUE",
                   help="assert your own goal on the fastest matching row, e.g. x_ceiling>=0.25, "
                   "shm:x_ray-numpy>=1, growth_x@4<=2.5 ([TRANSPORT:]KEY[@RECEIVERS], >= or <=); repeatable; "
                   f"exit status 1 on a miss. Keys: {', '.join(KEYS)}")
    p.add_argument("--json", metavar="PATH", help="write every figure as JSON (schema: docs/benchmarks.md)")
    p.add_argument("--plot", metavar="PATH.png", help="write a PNG of GB/s per transport and bucket size")


def _expectation(text: str):
    try:
        return parse_expectation(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def machine_info() -> dict[str, Any]:
    import psutil
    import ray
    import torch

    import weightsync

    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "hostname": socket.gethostname(), "cpu_model": model, "cpu_count": os.cpu_count(),
        "mem_total_bytes": psutil.virtual_memory().total, "load_avg_start": list(os.getloadavg()),
        "platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
        "ray": ray.__version__, "weightsync": weightsync.__version__,
    }


def run_bench(args: argparse.Namespace) -> int:
    import ray
    import torch

    from ..device import platform as detect_platform
    from . import layouts, report
    from .ceiling import device_ceilings, host_ceiling
    from .runner import Bench

    device = detect_platform() if args.device == "auto" else args.device
    label, manifest, weights_path = layouts.resolve(args.model, args.dtype)
    payload = manifest.total_bytes
    receivers = sorted(set(args.receivers))
    if min(receivers) < 1:
        raise SystemExit("weightsync bench: --receivers must be >= 1")
    if args.versions < 1 or args.warmup < 0:
        raise SystemExit("weightsync bench: --versions must be >= 1 and --warmup >= 0")
    backend = args.backend if args.backend != "auto" else backend_for(device)
    specs = list(manifest)
    dtypes = sorted({s.dtype for s in specs})
    print(f"weightsync bench: {label}, {len(specs)} tensors, {payload / 2**30:.2f} GiB, device={device}; "
          f"measuring the copy ceiling ...", file=sys.stderr)

    started = time.time()
    ceiling = host_ceiling(payload, repeats=args.ceiling_repeats)
    dev_ceil = device_ceilings(payload, torch.device(device), args.ceiling_repeats) if device != "cpu" else {}

    own_ray = not ray.is_initialized()
    if own_ray:
        store = int((args.object_store_gb or max(1.0, 3.5 * payload / 1e9 + 0.5)) * 1e9)
        ray.init(address=args.address, num_cpus=None if args.address else max(8, 2 * max(receivers) + 4),
                 include_dashboard=False, log_to_driver=True, logging_level="ERROR",
                 **({} if args.address else {"object_store_memory": store}))
    rows: list[dict[str, Any]] = []
    bench = None
    try:
        bench = Bench(manifest, receivers=max(receivers), device=device, weights_path=weights_path if args.real_weights else None,
                      versions=args.versions, warmup=args.warmup, progress=not args.no_progress,
                      check=not args.no_verify)
        for n in receivers:
            for b in args.baselines:
                if b.startswith("ray-"):
                    rows.append(bench.ray_row(b, n))
                else:
                    rows.append(bench.collective_row(b, n, backend))
                _echo(rows[-1], bench)
            for t in args.transport:
                for mb in args.bucket_mb:
                    for ck in dict.fromkeys(args.checksum):
                        rows.append(bench.sync_row(t, mb, n, backend=backend if t == "broadcast" else "auto",
                                                   checksum=ck == "on", digest=args.digest))
                        _echo(rows[-1], bench)
    finally:
        if bench is not None:
            bench.close()
        if own_ray:
            ray.shutdown()

    result: dict[str, Any] = {
        "schema": report.SCHEMA,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "wall_s": time.time() - started,
        "note": args.note,
        "machine": machine_info(),
        "args": {"model": args.model, "dtype": args.dtype, "transport": args.transport, "backend": backend,
                 "receivers": receivers, "bucket_mb": args.bucket_mb, "checksum": args.checksum, "digest": args.digest, "versions": args.versions,
                 "warmup": args.warmup, "device": device, "baselines": args.baselines,
                 "real_weights": bool(args.real_weights and weights_path), "expect": [e.text for e in args.expect]},
        "layout": {"name": label, "tensors": len(specs), "dtype": ",".join(dtypes),
                   "largest_tensor_bytes": max((s.nbytes for s in specs), default=0)},
        "payload_bytes": payload,
        "ceiling": ceiling,
        "device_ceilings": dev_ceil,
        "rows": rows,
    }
    result["machine"]["load_avg_end"] = list(os.getloadavg())
    report.add_ratios(result)
    counts = sorted({r["receivers"] for r in rows})
    result["comparisons"] = [f for f in (fastest(result, n) for n in counts) if f is not None]
    result["expectations"] = evaluate(result, args.expect)
    print(report.format_table(result))
    if args.json:
        report.write_json(result, args.json)
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot:
        why = report.write_plot(result, args.plot)
        print(f"--plot: {why}" if why else f"wrote {args.plot}", file=sys.stderr)
    return exit_status(result)


def exit_status(result: dict[str, Any]) -> int:
    """1 when a row failed (one that cannot run here is no failure) or an --expect missed."""
    failed = any(r.get("error") and r["kind"] != "unavailable" for r in result["rows"])
    return 1 if failed or not all(e["ok"] for e in result.get("expectations", [])) else 0


def _echo(row: dict[str, Any], bench: Any = None) -> None:
    if row["kind"] == "unavailable":
        msg = f"unavailable: {row['error']}"
    elif row.get("error"):
        msg = f"FAILED: {row['error']}"
    else:
        msg = f"median {row['median_s']:.3f}s, {row['gbps']:.2f} GB/s"
    bucket = f" {row['bucket_mb']:g}MiB" if row.get("bucket_mb") else ""
    print(f"  {row['name']}{bucket} x{row['receivers']}: {msg}", file=sys.stderr)
    if bench is not None and row.get("error") and row["kind"] != "unavailable":
        replaced = bench.revive()
        if replaced:
            row["replaced_actors"] = replaced
            print(f"  (replaced dead actors after this row: {', '.join(replaced)})", file=sys.stderr)
