"""Internal. ``weightsync bench``: arguments and the run from start to report."""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import sys
import time
from typing import Any

from weightsync.config import SyncConfig
from weightsync.device import backend_for

from . import memory_fit, results
from . import plan as plans
from .expect import evaluate, fastest
from .fixed_cost import DEVICE_SHARE, FIXED_COST, versions_per_round
from .interrupt import INTERRUPTED, remember_ctrl_c
from .options import BASELINE_CHOICES, PRESETS, TRANSPORTS, add_bench_arguments, apply_preset
from .plan import Item

__all__ = ["BASELINE_CHOICES", "PRESETS", "TRANSPORTS", "add_bench_arguments", "apply_preset", "run_bench"]

def _row_need(item: Item, manifest: Any, first_use: bool = True) -> tuple[int, int, str]:
    import dataclasses

    from weightsync.delta.sender import host_reserve
    from weightsync.errors import CapacityError
    from weightsync.manifest import plan_buckets
    from weightsync.transports.shm.transport import choose_mode

    _, name, n, mb, _, _ = item
    # the parties read WEIGHTSYNC_SHM_BUDGET_MB and friends too
    config = dataclasses.replace(SyncConfig.from_env(), bucket_mb=mb or SyncConfig.from_env().bucket_mb)
    payload, bucket, segs = manifest.total_bytes, config.bucket_bytes, config.shm_max_segments
    mode = None
    if name in ("shm", "auto"):
        try:  # the mode the shm sender will pick, from the same plan and budget
            plan = plan_buckets(manifest, bucket, config.align_bytes)
            mode = choose_mode(plan, config, reserve=host_reserve(config.delta, "shm", plan))
        except CapacityError:
            pass  # no mode fits: the row fails with the transport's own message
    need, shm = memory_fit.row_bytes(name, payload, bucket, n, segs, mode.need_bytes if mode else None, first_use)
    return need, shm, memory_fit.describe_row(name, payload, bucket, n, segs, mode.buffers if mode else 0)


def _row_refusal(item: Item, manifest: Any, first_use: bool = True) -> str | None:
    """Whether a row's buffers fit now, beside the models the actors already hold (``first_use``:
    a row with actors of its own has not made them yet)."""
    import psutil

    need, shm, detail = _row_need(item, manifest, first_use)
    if not need:
        return None
    vm = psutil.virtual_memory()
    what = f"{item[1]}{f' {item[3]:g}MiB' if item[3] else ''} x{item[2]}"
    return memory_fit.refusal(what, need, vm.available, vm.total, shm, memory_fit.shm_free(SyncConfig().shm_dir), detail)


def _size_refusal(label: str, manifest: Any, plan: list, receivers: int) -> str | None:
    """Whether a size can start at all: the copy ceiling's two buffers, then the trainer's and
    every engine's copy of the model beside the cheapest of its rows."""
    import psutil

    payload = manifest.total_bytes
    cheapest = min((_row_need(item, manifest)[0] for item in plan), default=0)
    need = max(2 * payload, memory_fit.models_bytes(payload, receivers) + cheapest)
    vm = psutil.virtual_memory()
    return memory_fit.refusal(label, need, vm.available, vm.total,
                       detail=f"the trainer's copy and {receivers} engine cop{'y' if receivers == 1 else 'ies'} of "
                              f"{payload / 2**30:.1f} GiB and the cheapest row's buffers")


def run_bench(args: argparse.Namespace) -> int:
    try:
        with remember_ctrl_c():
            return _run_bench(args)
    except KeyboardInterrupt:
        # the rows' actors are killed and their segment files reaped on the way out (interrupt.py)
        print("weightsync bench: interrupted; nothing written", file=sys.stderr)
        return INTERRUPTED


def _run_bench(args: argparse.Namespace) -> int:
    import ray

    from weightsync.device import platform as detect_platform

    from . import delta_rows, growth, interleave, layout_source, progress, rdt_rows, rounds, summary

    apply_preset(args)
    if args.hosts is not None and args.trainer_ranks is not None:  # sharded sending between isolated hosts
        from . import hosts_ranks

        return hosts_ranks.run(args)
    if args.hosts is not None:  # between isolated hosts on this machine: a program of its own
        from . import hosts

        return hosts.run(args)
    if args.trainer_ranks is not None:  # sharded sending from N trainer ranks on this host: a program of its own
        from . import ranks

        return ranks.run(args)
    device = detect_platform() if args.device == "auto" else args.device
    args.baselines = rdt_rows.expand(args.baselines, device)  # ray-rdt -> the RDT rows this device can run
    # smallest first: a size that fails or is skipped leaves the smaller ones measured
    sizes_in = sorted((layout_source.resolve(m, args.dtype) for m in dict.fromkeys(args.model)),
                      key=lambda s: s[1].total_bytes)
    receivers = sorted(set(args.receivers))
    if min(receivers + plans.fixed_receivers(args, receivers)) < 1:
        raise SystemExit("weightsync bench: --receivers and --fixed-cost-receivers must be >= 1")
    if args.versions < 1 or args.warmup < 0 or args.rounds < 1 or (args.barrier_versions or 0) < 0:
        raise SystemExit("weightsync bench: --versions and --rounds must be >= 1, --warmup and --barrier-versions >= 0")
    if (args.fixed_cost_versions or 1) < 1:
        raise SystemExit("weightsync bench: --fixed-cost-versions must be >= 1")
    args.fixed_versions = versions_per_round(args.rounds, args.fixed_cost_versions)
    if args.against and args.update != "random":
        raise SystemExit("weightsync bench: --against runs with --update random only (the other rev's trainer "
                         "knows no update model)")
    backend = args.backend if args.backend != "auto" else backend_for(device)
    largest = max(m.total_bytes for _, m, _ in sizes_in)

    started = time.time()
    # a row that has not started by then is recorded as not run (interleave.run_rounds)
    deadline = None if args.deadline_s is None else time.monotonic() + args.deadline_s
    machine = results.machine_info()  # now: its load_avg_start is the load before the run
    own_ray = not ray.is_initialized()
    if own_ray:
        # the Ray baselines put a whole version in the store; without them it holds small control objects
        want = 3.5 * largest / 1e9 + 0.5 if any(b in ("ray-user", "ray-numpy") for b in args.baselines) else 1.0
        store = int(min(args.object_store_gb or default_store_gb(want), _total_gb() / 2) * 1e9)
        # "local": start one as documented, even where another process left a cluster address in /tmp/ray
        ray.init(address=args.address or "local", num_cpus=None if args.address else max(8, 2 * max(receivers) + 4),
                 include_dashboard=False, log_to_driver=True, logging_level="ERROR",
                 **({} if args.address else {"object_store_memory": store}))
    sizes: list[dict[str, Any]] = []
    against = None
    try:
        if args.against:
            tree, short = interleave.extract_rev(args.against)
            against = {"rev": short, "tree": tree, "asked": args.against}
        plan = plans.sided(plans.rows(args, receivers), against)
        total = len(sizes_in) * args.rounds * sum(
            interleave.planned_versions(item, args.warmup, args.versions, args.barrier_versions, args.fixed_versions)
            for _, item in plan)
        eta = progress.Eta(total)
        with progress.overall(total, not args.no_progress):
            for label, manifest, weights_path in sizes_in:
                sizes.append(_run_size(args, label, manifest, weights_path, device, backend, receivers, against, eta,
                                       deadline))
    finally:
        if own_ray:
            ray.shutdown()
        if against:
            shutil.rmtree(against["tree"], ignore_errors=True)

    result: dict[str, Any] = {
        "schema": results.SCHEMA,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "wall_s": time.time() - started,
        "note": args.note,
        "machine": machine,
        "args": {"model": list(dict.fromkeys(args.model)), "dtype": args.dtype, "transport": args.transport,
                 "backend": backend, "receivers": receivers, "bucket_mb": args.bucket_mb, "checksum": args.checksum,
                 "digest": args.digest, "versions": args.versions, "warmup": args.warmup, "device": device,
                 "rounds": args.rounds, "preset": args.preset, "barrier_versions": args.barrier_versions,
                 "against": {k: against[k] for k in ("rev", "asked")} if against else None,
                 "update": args.update, "delta": args.delta, "fixed_cost": args.fixed_cost,
                 "fixed_cost_versions": args.fixed_versions if args.fixed_cost != "off" else None,
                 "fixed_cost_receivers": plans.fixed_receivers(args, receivers),
                 "baselines": args.baselines, "real_weights": bool(args.real_weights and any(w for *_, w in sizes_in)),
                 "expect": [e.text for e in args.expect], "deadline_s": args.deadline_s},
        "sizes": sizes,
    }
    late = sum(1 for size in sizes for r in size["rows"] if str(r.get("error", "")).startswith(interleave.PAST_DEADLINE))
    if late:
        print(f"weightsync bench: --deadline-s {args.deadline_s:g} passed; {late} row(s) not run", file=sys.stderr)
    result["machine"]["load_avg_end"] = list(os.getloadavg())
    for size in sizes:
        if size["ceiling"] is not None:
            results.add_ratios(size)
        counts = sorted({r["receivers"] for r in size["rows"]})
        size["comparisons"] = [f for f in (fastest(size, n) for n in counts) if f is not None]
        size["expectations"] = evaluate(size, args.expect)
        size["ab"] = rounds.ab_table(size["rows"])
        size["delta"] = delta_rows.table(size["rows"])
    result["growth"] = growth.table(sizes)
    result["skipped"] = growth.skipped(sizes)
    for size in sizes:
        print(results.format_table({**result, **size}) + "\n")
    grown = growth.format_table(result)
    if grown:
        print(grown)
    for size in sizes:  # last: the answer to "is this faster than what I would do?"
        lines = summary.closing_lines(size, len(sizes) > 1)
        if lines:
            print("\n".join(lines))
    if args.json:
        results.write_json(result, args.json)
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot:
        why = results.write_plot({**result, **sizes[0]}, args.plot) if len(sizes) == 1 else growth.write_plot(result, args.plot)
        print(f"--plot: {why}" if why else f"wrote {args.plot}", file=sys.stderr)
    return exit_status(result)


def _total_gb() -> float:
    import psutil

    return psutil.virtual_memory().total / 1e9


def default_store_gb(want_gb: float, shm_dir: str = "/dev/shm") -> float:
    """The object store when --object-store-gb is not given: what the baselines want, but at most
    half of what the shm directory has free (Ray keeps the store there; 3.5x a payload filled
    /dev/shm on a 24 GiB machine shared with other jobs; the other half is for the shm rows'
    segments, which live there too), and never under 0.1 GB (Ray's minimum is 0.075 GB)."""
    free = memory_fit.shm_free(shm_dir)
    want_gb = max(1.0, want_gb)
    return want_gb if free is None else max(0.1, min(want_gb, free / 1e9 / 2))


def _run_size(args: argparse.Namespace, label: str, manifest: Any, weights_path: str | None, device: str,
              backend: str, receivers: list[int], against: dict[str, str] | None, eta: Any = None,
              deadline: float | None = None) -> dict[str, Any]:
    """Every row of one model size, between actors that hold that model (made, then closed); its
    fixed-cost rows between actors of their own that hold its fixed-cost layout."""
    import ray
    import torch

    from weightsync.manifest import Manifest

    from . import fixed_cost, interleave
    from .actors import BenchRollout, BenchTrainer
    from .ceiling import device_ceilings, host_ceiling
    from .layouts import fixed_cost as fixed_cost_specs
    from .peak_memory import NodeShmem
    from .runner import Bench

    payload = manifest.total_bytes
    specs = list(manifest)
    size: dict[str, Any] = {
        "layout": {"name": label, "tensors": len(specs), "dtype": ",".join(sorted({s.dtype for s in specs})),
                   "largest_tensor_bytes": max((s.nbytes for s in specs), default=0)},
        "payload_bytes": payload, "ceiling": None, "device_ceilings": {}, "rows": [],
    }
    plan = plans.rows(args, receivers)
    main_plan = [item for item in plan if item[0] != FIXED_COST]
    fixed_plan = [item for item in plan if item[0] == FIXED_COST]
    fixed_manifest = Manifest(tuple(fixed_cost_specs(specs)))
    if fixed_plan:
        size["fixed_cost_layout"] = {"name": fixed_cost.layout_label(label), "tensors": len(specs),
                                     "payload_bytes": fixed_manifest.total_bytes}

    def skip(item: Item, why: str) -> dict[str, Any]:
        return plans.skipped(item, fixed_manifest.total_bytes if item[0] == FIXED_COST else payload, why)

    why = _size_refusal(label, manifest, main_plan, max(receivers)) if device == "cpu" and main_plan else None
    if deadline is not None and time.monotonic() > deadline:
        why = interleave.past_deadline(args.deadline_s)
    if why:
        print(f"weightsync bench: {label} ({payload / 2**30:.2f} GiB): {why}", file=sys.stderr)
        size["rows"] = [skip(item, why) for item in plan]
        return size
    if main_plan:
        print(f"weightsync bench: {label}, {len(specs)} tensors, {payload / 2**30:.2f} GiB, device={device}; "
              f"measuring the copy ceiling ...", file=sys.stderr)
        size["ceiling"] = host_ceiling(payload, repeats=args.ceiling_repeats)
        if device != "cpu":
            size["device_ceilings"] = device_ceilings(payload, torch.device(device), args.ceiling_repeats)
    else:  # what a version costs beyond its bytes needs no copy ceiling
        print(f"weightsync bench: {label}, fixed-cost rows only ({size['fixed_cost_layout']['name']}), "
              f"device={device}", file=sys.stderr)
    common = {"receivers": max(receivers), "device": device, "versions": args.versions, "warmup": args.warmup,
              "barrier_versions": args.barrier_versions,
              "weights_path": weights_path if args.real_weights else None, "progress": not args.no_progress,
              "check": not args.no_verify}
    # random bits, every version new: the fixed-cost rows time what does not depend on the bytes
    fixed_common = {**common, "receivers": max((item[2] for item in fixed_plan), default=1), "versions": 0, "barrier_versions":
                    args.fixed_versions, "weights_path": None, "fixed_cost": True, "device_share": DEVICE_SHARE}
    benches: dict[str, Any] = {}
    if main_plan:
        keep = memory_fit.keep_baselines(manifest.total_bytes, max(receivers), sum(b.startswith("bcast-") for b in args.baselines),
                                         SyncConfig.from_env().shm_max_segments,
                                         store=any(b in ("ray-user", "ray-numpy") for b in args.baselines)
                                         ) if device == "cpu" else frozenset({"rdt", "groups"})
        size["baseline_actors_kept"] = sorted(keep)  # the others' rows made theirs each round
        # beside fixed-cost actors on the device, a little less than half of it (Bench's device_share)
        share = 0.5 - DEVICE_SHARE if fixed_plan else 0.5
        benches["this"] = Bench(manifest, **common, update=args.update, keep_baselines=keep, device_share=share,
                                rdt=_rdt_early(args, device) if "rdt" in keep else (),
                                groups=_groups_early(args, manifest, device, backend, receivers) if "groups" in keep else ())
        size["update"] = ray.get(benches["this"].trainer.update_info.remote())
    sided = plans.sided(plan, against)

    def run_row(bench: Any, item: Item) -> dict[str, Any]:
        kind, name, n, mb, ck, delta = item
        with NodeShmem() as shm:
            if kind in ("transport", FIXED_COST):
                row = bench.sync_row(name, mb, n, backend=backend if name == "broadcast" else "auto",
                                     checksum=ck, digest=args.digest, delta=delta)
            elif name.startswith("ray-rdt"):
                row = bench.rdt_row(name, n)
            elif name.startswith("ray-"):
                row = bench.ray_row(name, n)
            else:
                row = bench.collective_row(name, n, backend)
        row["node_shmem_extra_bytes"] = shm.extra()
        return row

    def refusal(item: Item) -> str | None:  # the fixed-cost rows' actors exist from the start
        fixed = item[0] == FIXED_COST
        return _row_refusal(item, *((fixed_manifest, False) if fixed else (manifest, item[1] not in benches["this"].rdt_made)))

    try:
        if fixed_plan:
            benches["this fixed"] = Bench(fixed_manifest, **fixed_common)
        if against:
            tree = against["tree"]
            env = interleave.side_runtime_env(tree)
            side = {"runtime_env": env, "coordinator": interleave.side_coordinator(tree, env), "classes": (
                interleave.side_class(tree, BenchTrainer), interleave.side_class(tree, BenchRollout))}
            if main_plan:
                benches["against"] = Bench(manifest, **common, **side)
                interleave.check_side(benches["against"], tree)
            if fixed_plan:
                benches["against fixed"] = Bench(fixed_manifest, **fixed_common, **side)
                interleave.check_side(benches["against fixed"], tree)
        size["rows"] = interleave.run_rounds(
            sided, benches, run_row, refusal, skip, _echo, n_rounds=args.rounds, warmup=args.warmup,
            versions=args.versions, payload=payload, rev=against["rev"] if against else None,
            barrier_versions=args.barrier_versions, eta=eta,
            deadline=None if deadline is None else (deadline, args.deadline_s), fixed_versions=args.fixed_versions,
            bench_key=lambda side, item: f"{side} fixed" if item[0] == FIXED_COST else side)
    except KeyboardInterrupt:
        for b in benches.values():
            b.interrupted = True
        raise
    finally:
        for b in benches.values():
            b.close()
    return size


def _groups_early(args: argparse.Namespace, manifest: Any, device: str, backend: str,
                  receivers: list[int]) -> tuple[tuple[str, str], ...]:
    """The collective baselines whose group can start beside the bench's actors: on the host
    (a device group waits for whole devices on its row), and where baseline_rows finds the
    memory for it now."""
    from . import baseline_rows

    if device != "cpu":
        return ()
    n = max(receivers)
    return tuple((b, backend) for b in args.baselines if b in baseline_rows.METHODS
                 and baseline_rows.unavailable(b, backend, device, manifest.total_bytes, n) is None)


def _rdt_early(args: argparse.Namespace, device: str) -> tuple[str, ...]:
    """The Ray Direct Transport rows whose actors can start beside the bench's own: those that
    can run here and ask for no whole device (NCCL's wait for theirs on their row)."""
    from . import rdt_rows

    return tuple(b for b in args.baselines if b in rdt_rows.TRANSPORTS and b != "ray-rdt-nccl"
                 and rdt_rows.unavailable(b, device) is None)


def exit_status(result: dict[str, Any]) -> int:
    """1 when a row failed (one that cannot run here is no failure) or an --expect missed."""
    sizes = result.get("sizes", [result])
    failed = any(r.get("error") and r["kind"] != "unavailable" for s in sizes for r in s["rows"])
    missed = any(not e["ok"] for s in sizes for e in s.get("expectations", []))
    return 1 if failed or missed else 0


def _echo(row: dict[str, Any], bench: Any = None) -> None:
    if row["kind"] == "unavailable":
        msg = f"unavailable: {row['error']}"
    elif row.get("error"):
        msg = f"FAILED: {row['error']}"
    else:
        msg = f"median {row['median_s']:.3f}s" + (f", {row['gbps']:.2f} GB/s" if row.get("gbps") else "")
    bucket = f" {row['bucket_mb']:g}MiB" if row.get("bucket_mb") else ""
    print(f"  {row['name']}{bucket} x{row['receivers']}: {msg}{row.get('eta_text', '')}", file=sys.stderr)
    if bench is not None and row.get("error") and row["kind"] != "unavailable":
        replaced = bench.revive()
        if replaced:
            row["replaced_actors"] = replaced
            print(f"  (replaced dead actors after this row: {', '.join(replaced)})", file=sys.stderr)
