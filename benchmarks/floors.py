"""Floors: the least time this machine needs for the work a sync cannot skip, with none of
a transport's protocol around it (no coordinator, no Ray, no waits, no handshakes).

    python benchmarks/floors.py [--model qwen2.5-0.5b] [--bucket-mb 16] [--json PATH]

`weightsync bench` compares a transport with the copy ceiling (one copy of the payload, all
cores). A sync does more than one copy, so this script measures what the data path itself
costs, in separate processes like the real parties, using the library's own functions:

host path (what shm does), over one buffer in /dev/shm laid out as an shm segment
  stage     trainer process: a Packer fills the buffer, xxh3 per bucket while packing
  apply     rollout process: per bucket, verify its xxh3, then load_weights of its views
            (the benchmark's engine: one torch copy_ per tensor, as vLLM's loaders do)
  together  both at once, the rollout loading each bucket right behind the trainer; with
            "x N", N rollouts, one of them verifying (shm hashes a bucket once per node)
gloo path (what broadcast does on CPU), trainer rank 0 and one rollout rank 1
  flat      one broadcast of the whole payload, pre-packed: the wire limit (bcast-flat)
  buckets   the same bytes as one broadcast per bucket, two in flight, nothing else
  +load     the same, with the rollout loading each bucket into the engine as it lands

A transport's time minus its floor is what its protocol costs; a time below the floor is out
of reach on this machine whatever the transport does. Each figure is the median of
--repeats runs after one untimed run.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from weightsync_bench.actors import digest
from weightsync_bench.ceiling import host_ceiling
from weightsync_bench.engine import ToyEngine
from weightsync_bench.layout_source import resolve
from weightsync_bench.layouts import materialize
from weightsync_bench.results import machine_info

from weightsync.digest import verify
from weightsync.digest import xxh3 as checksum
from weightsync.manifest import BucketPlan, Manifest, Packer, PackViews, Unpacker, pack, plan_buckets
from weightsync.transports.shm.transport import layout, spans

MiB = 1 << 20
GLOO_CASES = ["flat", "buckets", "buckets+load"]


def _plan(model: str, bucket_mb: float) -> tuple[Manifest, BucketPlan]:
    _, manifest, _ = resolve(model, None)
    return manifest, plan_buckets(manifest, int(bucket_mb * MiB))


def _host_cases(receivers: list[int]) -> list[tuple[str, int, bool]]:
    """(work, receivers, xxh3 on) in the order measured."""
    cases = [("stage", 1, True), ("apply", 1, True), ("together", 1, True),
             ("stage", 1, False), ("apply", 1, False), ("together", 1, False)]
    return cases + [("together", n, True) for n in receivers if n > 1]


def _case_name(work: str, n: int, checksum: bool) -> str:
    return f"{work}{f' x{n}' if n > 1 else ''}{'' if checksum else ' (no xxh3)'}"


def _host_party(role: str, k: int, model: str, bucket_mb: float, repeats: int, receivers: list[int],
                path: str, barrier: Any, out: Any) -> None:
    """``role`` stage (the trainer) or apply (rollout ``k``). They share one buffer in /dev/shm,
    laid out as an shm segment; the trainer marks each bucket in the header once written
    and the rollouts load right behind it, as shm's receivers do. Rollout 0 verifies each
    bucket, the others only load: shm hashes a bucket once per node."""
    torch.set_num_threads(1)  # as in a Ray actor (OMP_NUM_THREADS=1)
    manifest, plan = _plan(model, bucket_mb)
    size, bases = layout(plan)
    buf = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
    # header words: bucket b written [b], bucket b verified [count + b]; fits in layout's header
    words = buf[: 16 * plan.bucket_count].view(torch.int64)
    ready, verified = words[: plan.bucket_count], words[plan.bucket_count:]
    windows = [buf[bases[b]: bases[b] + bucket.nbytes] for b, bucket in enumerate(plan.buckets)]
    tensors = materialize(manifest, seed=0) if role == "stage" else None
    if role == "stage":
        pack(plan, manifest, tensors, windows)  # untimed: pages resident
    barrier.wait()
    if role == "stage":
        os.unlink(path)  # every party has it mapped now: the pages go when the last one exits
    # what the trainer would announce: each bucket's xxh3
    sums = {b: checksum(w) for b, w in enumerate(windows)} if role == "apply" and k == 0 else {}
    engine = ToyEngine(manifest) if role == "apply" else None
    unpacker = Unpacker(plan, manifest)
    span = spans(buf, bases, plan)

    def stage(hashed: bool, run: int) -> None:
        packer, views, kind = Packer(plan, manifest, tensors), PackViews(), "xxh3" if hashed else None
        for b in range(plan.bucket_count):
            packer.fill(b, windows[b], kind, views)
            ready[b] = run  # after the bucket's bytes: x86 keeps stores in order

    def apply(hashed: bool, run: int | None) -> None:
        for b in range(plan.bucket_count):
            # the others load a bucket only once rollout 0 verified it, as on shm
            word = verified if hashed and k else ready
            while run is not None and int(word[b]) != run:
                time.sleep(20e-6)
            if hashed and k == 0:
                verify("xxh3", b, windows[b], sums[b], 0)
                if run is not None:
                    verified[b] = run
            engine.copy_in(unpacker.unpack(b, windows[b], span))

    times: dict[str, list[float]] = {}
    for c, (work, n, hashed) in enumerate(_host_cases(receivers)):
        if role == "stage":
            mine = work in ("stage", "together")
        else:
            mine = (work == "apply" and k == 0) or (work == "together" and k < n)
        for r in range(repeats + 1):
            run = 1 + c * (repeats + 1) + r
            barrier.wait()
            t0 = time.perf_counter()
            if mine and role == "stage":
                stage(hashed, run)
            elif mine:
                apply(hashed, run if work == "together" else None)
            if r and mine:
                times.setdefault(_case_name(work, n, hashed), []).append(time.perf_counter() - t0)
    out.put({"role": role, "times": times, "digest": digest(engine.params if engine else tensors)})


def _gloo_party(rank: int, model: str, bucket_mb: float, repeats: int, store_path: str, out: Any) -> None:
    torch.set_num_threads(1)
    manifest, plan = _plan(model, bucket_mb)
    pg = dist.ProcessGroupGloo(dist.FileStore(store_path, 2), rank, 2, timedelta(seconds=300))
    # the version laid out as shm lays it out (page-aligned buckets); zeroed: pages resident
    size, bases = layout(plan)
    packed = torch.zeros(size, dtype=torch.uint8)
    if rank == 0:
        tensors = materialize(manifest, seed=0)
        pack(plan, manifest, tensors, [packed[bases[b]: bases[b] + plan.buckets[b].nbytes] for b in range(plan.bucket_count)])
    else:
        engine = ToyEngine(manifest)  # the rollout gets its bytes from the wire
    unpacker = Unpacker(plan, manifest)
    wires = [torch.zeros(plan.bucket_bytes, dtype=torch.uint8) for _ in range(2)]
    flat = packed[bases[0]:]  # every byte of the version, pre-packed: bcast-flat's buffer

    def bcast(t: torch.Tensor) -> Any:
        return pg.broadcast([t], dist.BroadcastOptions())

    def buckets(load: bool) -> None:
        # the sender sends straight from its packed buffer (no pack cost: a floor); the
        # rollout receives into two buffers and, with load, loads bucket b while b+1 lands
        def post(b: int) -> Any:
            n = plan.buckets[b].nbytes
            src = packed[bases[b]: bases[b] + n] if rank == 0 else wires[b % 2][:n]
            return bcast(src)

        works = {b: post(b) for b in range(min(2, plan.bucket_count))}
        for b in range(plan.bucket_count):
            works.pop(b).wait()
            if rank == 1 and load:
                engine.copy_in(unpacker.unpack(b, wires[b % 2][: plan.buckets[b].nbytes]))
            if b + 2 < plan.bucket_count:
                works[b + 2] = post(b + 2)

    times: dict[str, list[float]] = {}
    for case in GLOO_CASES:
        for r in range(repeats + 1):
            pg.barrier().wait()
            t0 = time.perf_counter()
            if case == "flat":
                bcast(flat).wait()
            else:
                buckets(load=case == "buckets+load")
            if r:
                times.setdefault(case, []).append(time.perf_counter() - t0)
    out.put({"rank": rank, "times": times, "digest": digest(tensors if rank == 0 else engine.params)})


def _run(target: Any, args_of: list[tuple]) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*a, out), daemon=True) for a in args_of]
    for p in procs:
        p.start()
    results: list[dict[str, Any]] = []
    deadline = time.monotonic() + 1800
    try:
        while len(results) < len(procs):
            try:
                results.append(out.get(timeout=1.0))
            except queue.Empty:
                # a party that died never reaches the barrier: the others would wait for it forever
                dead = [f"party {i} (exit code {p.exitcode})" for i, p in enumerate(procs)
                        if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(f"floors: {', '.join(dead) or 'no result within 1800 s'}") from None
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return results


def _together(results: list[dict[str, Any]], order: list[str]) -> dict[str, float]:
    """Median over repeats of the slower party's time, per case."""
    out: dict[str, float] = {}
    for k in order:
        runs = [r["times"][k] for r in results if k in r["times"]]
        out[k] = statistics.median(max(t) for t in zip(*runs))
    return out


def measure(model: str, bucket_mb: float, repeats: int, receivers: list[int], gloo: bool = True) -> dict[str, Any]:
    manifest, plan = _plan(model, bucket_mb)
    nbytes = manifest.total_bytes
    result: dict[str, Any] = {"model": model, "bytes": nbytes, "tensors": len(manifest), "bucket_mb": bucket_mb,
                              "buckets": plan.bucket_count, "repeats": repeats, "receivers": receivers,
                              "machine": machine_info(), "ceiling": host_ceiling(nbytes)}
    ctx = mp.get_context("spawn")
    parties = [("stage", 0)] + [("apply", k) for k in range(max(receivers))]
    barrier = ctx.Barrier(len(parties))
    fd, path = tempfile.mkstemp(prefix="wsync-floors-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        os.ftruncate(fd, layout(plan)[0])
        host = _run(_host_party, [(role, k, model, bucket_mb, repeats, receivers, path, barrier)
                                  for role, k in parties])
    finally:
        os.close(fd)
        if os.path.exists(path):  # a party failed before the trainer unlinked it
            os.unlink(path)
    result["host_s"] = _together(host, [_case_name(*c) for c in _host_cases(receivers)])
    result["verified"] = len({r["digest"] for r in host}) == 1  # every engine equals the trainer
    if gloo:
        with tempfile.TemporaryDirectory(prefix="wsync-floors-") as d:
            path = os.path.join(d, "store")
            ranks = _run(_gloo_party, [(rank, model, bucket_mb, repeats, path) for rank in (0, 1)])
        result["gloo_s"] = _together(ranks, GLOO_CASES)
        result["verified"] = result["verified"] and len({r["digest"] for r in ranks}) == 1
    one_copy = result["ceiling"]["seconds"]
    h = result["host_s"]
    reading = {
        # what shm could reach at best, in the bench's terms
        "shm_best_x_ceiling": one_copy / h["together"],
        "shm_best_x_ceiling_no_xxh3": one_copy / h["together (no xxh3)"],
        "prestaged_barrier_floor_x_one_copy": h["apply"] / one_copy,
        "prefetched_barrier_floor_x_one_copy": h["apply (no xxh3)"] / one_copy,
    }
    for n in receivers:
        if n > 1:
            reading[f"shm_best_growth_{n}_vs_1_receiver"] = h[f"together x{n}"] / h["together"]
    if gloo:
        g = result["gloo_s"]
        reading["bucketed_x_flat"] = g["flat"] / g["buckets"]
        reading["bucketed_with_load_x_flat"] = g["flat"] / g["buckets+load"]
    result["reading"] = reading
    return result


def format_result(r: dict[str, Any]) -> str:
    gb = r["bytes"] / 1e9
    c = r["ceiling"]
    lines = [f"floors: {r['model']} ({r['tensors']} tensors, {r['bytes'] / 2**30:.2f} GiB), {r['bucket_mb']:g} MiB buckets, "
             f"median of {r['repeats']}",
             f"machine: {r['machine']['cpu_model']}, {r['machine']['cpu_count']} cores; copy ceiling "
             f"{c['gbps']:.2f} GB/s ({c['method']}, one copy {c['seconds']:.3f} s)", "",
             f"{'work':34} {'s':>7} {'GB/s':>6} {'x ceiling':>9}"]
    rows = [(f"host: {k}", v) for k, v in r["host_s"].items()] + [(f"gloo: {k}", v) for k, v in r.get("gloo_s", {}).items()]
    for name, s in rows:
        lines.append(f"{name:34} {s:7.3f} {gb / s:6.2f} {c['seconds'] / s:9.2f}")
    x = r["reading"]
    lines += ["", "what this means for the transports' figures (a transport can only be slower than its floor):",
              f"  shm / copy ceiling at best: {x['shm_best_x_ceiling']:.2f}x "
              f"({x['shm_best_x_ceiling_no_xxh3']:.2f}x without xxh3)",
              f"  pre-staged barrier / one copy at least: {x['prestaged_barrier_floor_x_one_copy']:.2f}x "
              f"({x['prefetched_barrier_floor_x_one_copy']:.2f}x once prefetch() verified it)"]
    for key, v in x.items():
        if key.startswith("shm_best_growth_"):
            n = key.split("_")[3]
            lines.append(f"  shm time with {n} receivers / 1 receiver at least: {v:.2f}x")
    if "bucketed_x_flat" in x:
        lines.append(f"  bucketed gloo broadcast / one flat broadcast at best: {x['bucketed_with_load_x_flat']:.2f}x "
                     f"with the rollout loading, {x['bucketed_x_flat']:.2f}x for the wire alone")
    lines.append(f"  engine weights bit-exact after every run: {'yes' if r['verified'] else 'NO'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="qwen2.5-0.5b", help="built-in layout or safetensors file/folder")
    p.add_argument("--bucket-mb", type=float, default=16.0)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--receivers", type=int, nargs="+", default=[1, 4], help="rollout counts on the host path")
    p.add_argument("--no-gloo", action="store_true", help="host path only")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    result = measure(args.model, args.bucket_mb, args.repeats, sorted(set(args.receivers) | {1}),
                     gloo=not args.no_gloo)
    print(format_result(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2, default=str)
    return 0 if result["verified"] else 1


if __name__ == "__main__":
    sys.exit(main())
