"""Internal. ``weightsync bench --trainer-ranks N``: sharded sending on one host (issue 56).

N trainer ranks (Ray actors, one gloo process group over a free local port, a 1-D CPU
DeviceMesh) hold the layout as FSDP2 holds a model: every tensor of one or more dimensions a
DTensor ``Shard(0)`` (uneven splits included), 0-dim tensors plain on every rank. K receivers on
the same host, transport shm. Two rows, each a session (a coordinator) of its own, since a
session's first version fixes its manifest:

- ``gather`` (today's path): every rank walks the parameters calling ``full_tensor()`` (a
  generator passed to stage(), as the verl adapter did), rank 0 packs the whole tensors;
- ``shards``: every rank passes its local DTensors, each writes its own rows into the segment.

The clock of both: from a ``dist.barrier()`` on every rank (the end of the update) until rank
0's ``stage()`` returned (the version is staged). Then sync(), and every receiver is checked
bit for bit against the full tensors. The rows take turns: each round runs ``--versions``
versions of each row, the order flipped every round (rounds.round_order), so a neighbour's load
lands on both rows alike; ``--warmup`` versions of each row first, untimed (shm makes and maps
its two segments).

Memory: each rank's largest growth during stage(), over every version, against its shard plus
two buckets (what a rank writing its own rows touches: its rows, and the ends of the buckets
it shares with its neighbours, which the last writer digests whole). RSS growth counts the
segment's pages the rank touches for the first time; private growth (RssAnon) is what the
rank allocates: the gather's full tensors.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import sys
import threading
import time
from typing import Any

ROWS = ("gather", "shards")
SCHEMA = "weightsync.bench-ranks/1"
WHAT = {"gather": "full_tensor() on every rank, rank 0 packs (today's path)",
        "shards": "every rank writes its own rows of its local DTensors"}
TIMEOUT_S = 600.0  # one version on a loaded 2-core VM takes seconds; never hang the run


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sharded sending on one host")
    g.add_argument("--trainer-ranks", type=trainer_ranks, default=None, metavar="N|HxN",
                   help="run N trainer ranks (gloo, a 1-D CPU mesh, Shard(0) DTensors) and time the gather and "
                        "shards rows side by side on shm (--receivers default 2; --warmup versions once before "
                        "the rounds; first --bucket-mb and --checksum); with --hosts, HxN: H trainer hosts of N "
                        "ranks each, one group over all, the other hosts receiving over relay (--receivers per "
                        "receiving host, default 1)")


def trainer_ranks(text: str) -> tuple[int, int]:
    """``--trainer-ranks``: ``N`` (N ranks on one host) or ``HxN`` (H hosts of N ranks each), as
    (H, N)."""
    try:
        hosts, per_host = (int(x) for x in text.lower().split("x")) if "x" in text.lower() else (1, int(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not N or HxN") from None
    if hosts < 1 or per_host < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: H and N must be >= 1")
    return hosts, per_host


# -- memory of a rank ------------------------------------------------------------------------------

def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


class _PrivatePeak:
    """Peak RssAnon (private pages: what full_tensor() allocates) over its value at start,
    sampled every ``interval`` s by a thread. Sampled, since no counter keeps a high-water mark
    of anonymous pages alone; a buffer that lives 5 ms or less may be missed. The segment is
    shared (RssShmem), so writing rows into it is not a rank's private growth."""

    def __init__(self, interval: float = 0.005):
        self.interval, self.base = interval, _status_kib("RssAnon")
        self.peak, self._stop = self.base, threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-rss-anon", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, _status_kib("RssAnon"))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(0, max(self.peak, _status_kib("RssAnon")) - self.base) * 1024


def _trim() -> None:
    """Hand freed heap back to the kernel (glibc's malloc_trim). glibc keeps freed blocks under
    its mmap threshold, which rises to 32 MiB once a large block was freed: without a trim a
    rank's freed full tensors stay resident, and the next version's full_tensor() buffers
    reuse them unseen by RSS, so the gather's growth would be under-reported."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: growth may be under-reported


# -- parties ---------------------------------------------------------------------------------------

def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class TrainerRank:
    """Trainer rank ``rank`` of ``ranks``: the layout's weights (materialize, seed 0) cut to this
    rank's rows, one WeightSender per row's session, all on one process group, which meets at
    ``master``:``port`` (rank 0's address: this host's loopback, or between hosts rank 0's host)."""

    def __init__(self, manifest_wire: list, rank: int, ranks: int, port: int, master: str = "127.0.0.1"):
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Shard, distribute_tensor

        from weightsync.manifest import Manifest

        from .layouts import materialize
        from .updates import Versions

        if master == "127.0.0.1":
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the ranks meet on this host
        dist.init_process_group("gloo", init_method=f"tcp://{master}:{port}", rank=rank, world_size=ranks)
        self.rank, self.mesh = rank, init_device_mesh("cpu", (ranks,))
        self.manifest = Manifest.from_wire(manifest_wire)
        full = materialize(self.manifest, seed=0)
        self.named: dict[str, Any] = {}
        for name in list(full):
            t = full.pop(name)
            if t.dim():
                # src_data_rank=None: each rank cuts its rows from its own copy, no collective; the
                # clone lets the full tensor go (the chunk is a view of it)
                d = distribute_tensor(t, self.mesh, [Shard(0)], src_data_rank=None)
                t = DTensor.from_local(d.to_local().clone(), self.mesh, d.placements, run_check=False,
                                       shape=d.shape, stride=d.stride())
            self.named[name] = t
        del full
        _trim()
        # the bench's update (every byte + 1 a version) applied to the rows: the same as applying
        # it to the full tensors, which the driver does to check the receivers against
        self.versions = Versions({n: t.to_local() if isinstance(t, DTensor) else t for n, t in self.named.items()})
        self.shard_bytes = sum(t.numel() * t.element_size() for t in self.versions.tensors.values())
        self.updates = 0
        self.senders: dict[str, Any] = {}

    def open(self, row: str, coordinator: Any, config: dict, receivers: int) -> int:
        from weightsync.config import SyncConfig
        from weightsync.sender import WeightSender

        self.senders[row] = WeightSender(coordinator, rank=self.rank, config=SyncConfig.load(config),
                                         expected_receivers=receivers)
        return self.shard_bytes

    def step(self, row: str, version: int, update: int, memory: bool = True) -> dict[str, Any]:
        """One version of ``row``: the weights brought to ``update`` (counted over both rows, so a
        failed version leaves no rank behind the driver's reference), the barrier that ends the
        update, stage (timed: ``staged_s``), sync (``synced_s``: from the barrier until sync()
        returned, every receiver committed, on rank 0). ``memory``: sample this rank's growth
        during stage() (a thread polling every 5 ms; off, the growth figures are 0)."""
        import torch.distributed as dist

        from .peak_memory import PeakTracker

        sender = self.senders[row]
        self._advance(update)
        named: Any = self.named
        if row == "gather":
            named = ((n, t.full_tensor() if hasattr(t, "full_tensor") else t) for n, t in self.named.items())
        _trim()  # the last version's buffers, freed, must not hide this one's growth
        dist.barrier()
        # RSS high-water: VmHWM, reset here through /proc/self/clear_refs (PeakTracker; where the
        # kernel refuses, VmHWM stays the lifetime peak and the figure says little), so no peak is
        # missed between samples; it counts the segment's pages this rank touches first, too
        rss, private = (PeakTracker(), _PrivatePeak()) if memory else (None, None)
        if rss is not None:
            rss.start()
        t0 = time.perf_counter()
        sender.stage(version, named).wait()
        staged_s = time.perf_counter() - t0
        out = {"staged_s": staged_s, "rss_growth": rss.extra() if rss else 0,
               "private_growth": private.stop() if private else 0}
        result = sender.sync(version)
        out["synced_s"] = time.perf_counter() - t0
        # rank 0's shm mode: "stream" where too little memory was free for two whole versions
        mode = getattr(getattr(sender.transport, "session", None), "mode", None)
        out.update(barrier_s=result.barrier_s, sharded=getattr(sender, "rows", None) is not None, mode=mode)
        return out

    def _advance(self, update: int) -> None:
        while self.updates < update:
            self.updates += 1
            self.versions.apply(self.updates)

    def ray_put_rows(self, update: int) -> dict[str, Any]:
        """The ray-numpy row: the weights brought to ``update``, the barrier that ends the update,
        then this rank's rows as numpy into Ray's object store (0-dim tensors from rank 0 only),
        as a Ray user moves sharded weights; the receivers take every rank's ref (ray_load)."""
        import ray
        import torch.distributed as dist

        from .actors import numpy_views

        self._advance(update)
        dist.barrier()
        t0 = time.monotonic()
        ref = ray.put(numpy_views({n: t for n, t in self.versions.tensors.items() if t.dim() or self.rank == 0}))
        return {"t0": t0, "put_s": time.monotonic() - t0, "ref": ref}

    def drop(self, row: str) -> None:
        sender = self.senders.pop(row, None)
        if sender is not None:
            sender.close()

    def close(self) -> None:
        import torch.distributed as dist

        try:
            for row in list(self.senders):
                self.drop(row)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()


def rollout_class() -> type:
    from .actors import BenchRollout

    class RanksRollout(BenchRollout):
        """A bench rollout with a receiver per row's session, all loading the one engine: the
        rows run one version at a time and each is checked before the other writes it."""

        def open_row(self, row: str, coordinator: Any, config: dict) -> None:
            self.open(coordinator, config)
            self.state[row] = self.receiver

        def apply_row(self, row: str, version: int) -> dict[str, Any]:
            self.receiver = self.state[row]
            return self.apply(version)

        def close(self) -> None:
            for receiver in self.state.values():
                receiver.close()
            self.state.clear()
            self.receiver = None

    return RanksRollout


# -- the run ---------------------------------------------------------------------------------------

def wait_all(refs: list, timeout: float = TIMEOUT_S) -> list:
    """ray.get of every ref, raising the first remote error as soon as it lands (a rank that
    failed leaves the others waiting for it until their own timeout)."""
    import ray

    pending, deadline = list(refs), time.monotonic() + timeout
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            raise TimeoutError(f"{len(pending)} of {len(refs)} calls still running after {timeout:.0f} s")
        ray.get(ready[0])
    return ray.get(refs)


class _Row:
    def __init__(self, name: str):
        self.name, self.coordinator = name, None
        self.version, self.error, self.verified = 0, None, None
        self.staged: list[float] = []
        self.barrier: list[float] = []
        self.rss: list[int] = []  # per rank: the largest growth over every version
        self.private: list[int] = []
        self.sharded: list[bool] = []
        self.shard_bytes: list[int] = []
        self.bound: list[int] = []
        self.pending: list = []


def run(args: argparse.Namespace) -> int:
    import ray

    from . import results
    from .layouts import layout

    hosts, n = args.trainer_ranks
    k = max(args.receivers)
    if hosts != 1:
        raise SystemExit(f"weightsync bench: --trainer-ranks {hosts}x{n} spans {hosts} hosts: it needs --hosts "
                         f"(at least {hosts + 1})")
    if n < 1 or k < 1:
        raise SystemExit("weightsync bench: --trainer-ranks and --receivers must be >= 1")
    label = args.model[0]
    manifest = layout(label, args.dtype or "bfloat16")
    cfg = {"transport": "shm", "device": "cpu", "bucket_mb": args.bucket_mb[0], "checksum": args.checksum[0] == "on",
           "digest": args.digest, "sync_timeout_s": TIMEOUT_S / 2, "connect_timeout_s": 120.0,
           # throughput, not liveness, is measured: a busy machine must not abort a version
           "heartbeat_timeout_s": 60.0}
    started, machine = time.time(), results.machine_info()
    own_ray = not ray.is_initialized()
    if own_ray:
        ray.init(address=args.address or "local", num_cpus=None if args.address else n + k + 4,
                 include_dashboard=False, log_to_driver=True, logging_level="ERROR",
                 **({} if args.address else {"object_store_memory": 200 * 2**20}))
    try:
        rows = _measure(args, manifest, cfg, n, k)
    finally:
        if own_ray:
            ray.shutdown()
    out = _result(args, manifest, cfg, n, k, rows, machine, started)
    print(table(out))
    if args.json:
        results.write_json(out, args.json)
        print(f"wrote {args.json}", file=sys.stderr)
    return 0 if all(r["verified"] and not r["error"] for r in out["rows"]) else 1


def _measure(args: argparse.Namespace, manifest: Any, cfg: dict, n: int, k: int) -> dict[str, _Row]:
    import ray

    from weightsync.config import SyncConfig
    from weightsync.coordinator.client import Coordinator

    from .bits import digest
    from .layouts import materialize
    from .rounds import schedule
    from .rowkit import describe_error
    from .updates import Versions

    wire, opts = manifest.to_wire(), {"num_cpus": 0}
    port = free_port()
    ranks = [ray.remote(TrainerRank).options(**opts).remote(wire, r, n, port) for r in range(n)]
    rollout = ray.remote(rollout_class())
    rollouts = [rollout.options(**opts).remote(wire, f"rollout-{i}", i, "cpu") for i in range(k)]
    # the full tensors the receivers must hold, stepped as the ranks step their rows
    reference = Versions(materialize(manifest, seed=0))
    rows = {name: _Row(name) for name in ROWS}
    bucket = SyncConfig.load(cfg).bucket_bytes
    try:
        for row in rows.values():
            row.coordinator = Coordinator.create(cfg, name=f"wsbench-ranks-{os.getpid()}-{row.name}")
            wait_all([r.open_row.remote(row.name, row.coordinator, cfg) for r in rollouts])
            row.shard_bytes = wait_all([t.open.remote(row.name, row.coordinator, cfg, k) for t in ranks])
            row.rss, row.private = [0] * n, [0] * n
        step = 0
        # warm-up once (shm makes and maps its two segments), then the rounds
        for round_index, name, versions in schedule(list(ROWS), args.warmup, args.rounds, args.versions):
            row = rows[name]
            for _ in range(versions):
                if row.error:
                    break
                step += 1
                row.version += 1
                reference.apply(step)
                try:
                    _version(row, ranks, rollouts, reference.tensors, digest, step, timed=round_index >= 0)
                except Exception as exc:
                    row.error = describe_error(exc)
                    print(f"  {name} v{row.version}: FAILED: {row.error}", file=sys.stderr)
                    give_up(row, ranks)
        for row in rows.values():
            row.bound = [s + 2 * bucket for s in row.shard_bytes]
        return rows
    finally:
        close_parties(ranks, rollouts, rows)


def _version(row: _Row, ranks: list, rollouts: list, reference: dict, digest: Any, update: int,
             timed: bool) -> None:
    applied = [r.apply_row.remote(row.name, row.version) for r in rollouts]  # receivers wait first
    steps = [t.step.remote(row.name, row.version, update) for t in ranks]
    row.pending = applied + steps  # a failed version's other calls: give_up collects them
    outs = wait_all(steps)
    wait_all(applied)
    row.pending = []
    import ray

    if outs[0]["mode"] != "whole":
        # a streaming session moves the bytes in sync(), and shards need whole versions: the
        # staged clock would time something else
        raise RuntimeError(f"the {row.name} session's shm streams through a ring (mode {outs[0]['mode']!r}): its budget "
                           f"held no two whole versions when it began (too little memory free, or shm_budget_mb); "
                           f"free memory or set WEIGHTSYNC_SHM_BUDGET_MB")
    want = digest(reference)
    got = ray.get([r.digest.remote() for r in rollouts], timeout=TIMEOUT_S)
    row.verified = (row.verified is not False) and all(g == want for g in got)
    row.sharded = [o["sharded"] for o in outs]
    print(f"  {row.name} v{row.version}{'' if timed else ' (warm-up)'}: staged {outs[0]['staged_s']:.3f} s, "
          f"barrier {outs[0]['barrier_s']:.3f} s{'' if row.verified else ', receivers DIFFER'}", file=sys.stderr)
    if timed:
        row.staged.append(outs[0]["staged_s"])
        row.barrier.append(outs[0]["barrier_s"])
    # memory over every version, warm-up too: a rank's first write into each segment is where its
    # shared pages (its rows, and the buckets it digests) first count
    row.rss = [max(a, o["rss_growth"]) for a, o in zip(row.rss, outs, strict=True)]
    row.private = [max(a, o["private_growth"]) for a, o in zip(row.private, outs, strict=True)]


def give_up(row: _Row, ranks: list) -> None:
    """A failed row: its coordinator goes, so ranks still waiting in that session fail at once
    instead of at their timeout, and their senders close; the other row goes on."""
    import ray

    try:
        row.coordinator.shutdown()
    except Exception:
        pass
    row.coordinator = None
    ray.wait([t.drop.remote(row.name) for t in ranks], num_returns=len(ranks), timeout=120)
    for ref in row.pending:  # fetched, so Ray does not log their errors as unhandled
        try:
            ray.get(ref, timeout=60)
        except Exception:
            pass


def close_parties(ranks: list, rollouts: list, rows: dict[str, _Row]) -> None:
    import ray

    ray.wait([a.close.remote() for a in (*ranks, *rollouts)], num_returns=len(ranks) + len(rollouts), timeout=120)
    for row in rows.values():
        if row.coordinator is not None:
            try:
                row.coordinator.shutdown()
            except Exception:
                pass
    for a in (*ranks, *rollouts):
        ray.kill(a)


def _result(args: argparse.Namespace, manifest: Any, cfg: dict, n: int, k: int, rows: dict[str, _Row],
            machine: dict, started: float) -> dict[str, Any]:
    from .rounds import spread

    out_rows = []
    for row in rows.values():
        shard, bound = row.shard_bytes or [0] * n, row.bound or [0] * n
        out_rows.append({
            "name": row.name, "what": WHAT[row.name], "error": row.error, "verified": bool(row.verified),
            "sharded": row.sharded, "seconds": row.staged, **spread(row.staged),
            "max_s": max(row.staged) if row.staged else None,
            "barrier_s": spread(row.barrier)["median_s"], "barrier_seconds": row.barrier,
            "ranks": [{"rank": r, "shard_bytes": shard[r], "bound_bytes": bound[r], "rss_growth_bytes": row.rss[r],
                       "private_growth_bytes": row.private[r]} for r in range(len(row.rss))],
            # RSS counts shared pages: shm maps a segment with MAP_POPULATE, so a rank's first version in
            # each slot counts the whole segment, not only the rows it writes; private growth does not
            "within_bound": bool(row.rss) and all(g <= b for g, b in zip(row.rss, bound, strict=True)),
            "private_within_bound": bool(row.rss) and all(g <= b for g, b in zip(row.private, bound, strict=True)),
        })
    by = {r["name"]: r for r in out_rows}
    g, s = by["gather"]["median_s"], by["shards"]["median_s"]
    return {
        "schema": SCHEMA, "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "wall_s": time.time() - started, "note": args.note, "machine": {**machine, "load_avg_end": list(os.getloadavg())},
        "args": {"model": args.model[0], "trainer_ranks": n, "receivers": k, "transport": "shm",
                 "bucket_mb": cfg["bucket_mb"], "checksum": cfg["checksum"], "rounds": args.rounds,
                 "versions": args.versions, "warmup": args.warmup},
        "layout": {"name": args.model[0], "tensors": len(list(manifest))}, "payload_bytes": manifest.total_bytes,
        "rows": out_rows, "gather_over_shards": g / s if g and s else None,
    }


def table(result: dict[str, Any]) -> str:
    a, mib = result["args"], 2**20
    lines = [f"weightsync bench --trainer-ranks {a['trainer_ranks']}: {a['model']} "
             f"({result['payload_bytes'] / 2**30:.2f} GiB), shm, {a['receivers']} receivers, {a['bucket_mb']:g} MiB "
             f"buckets, {a['rounds']} rounds x {a['versions']} versions (after {a['warmup']} warm-up)",
             "clock: from the barrier ending the update on every rank until rank 0's stage() returned",
             f"{'row':<7} {'staged median s':>15} {'min s':>7} {'max s':>7} {'IQR s':>7} {'barrier s':>9}  "
             f"{'rank growth MiB, RSS / private (bound: shard + 2 buckets)':<58} bits"]
    for r in result["rows"]:
        if r["error"] and not r["seconds"]:
            lines.append(f"{r['name']:<7} FAILED: {r['error']}")
            continue
        growth = ", ".join(f"{x['rss_growth_bytes'] / mib:.0f}/{x['private_growth_bytes'] / mib:.0f}"
                           f" ({x['bound_bytes'] / mib:.0f})" for x in r["ranks"])
        lines.append(f"{r['name']:<7} {r['median_s']:>15.3f} {r['min_s']:>7.3f} {r['max_s']:>7.3f} {r['iqr_s']:>7.3f} "
                     f"{r['barrier_s']:>9.3f}  {growth:<58} {'ok' if r['verified'] else 'DIFF'}"
                     + ("" if r["name"] != "shards" or all(r["sharded"]) else "  (the session gathered: not sharded)")
                     + (f"  FAILED later: {r['error']}" if r["error"] else ""))
    said = {True: "yes", False: "no"}
    bounds = [f"{r['name']} {said[r['within_bound']]} / {said[r['private_within_bound']]}"
              for r in result["rows"] if r["seconds"]]
    if bounds:
        lines.append(f"within shard + 2 buckets on every rank, RSS / private: {'; '.join(bounds)} (RSS counts "
                     "the segment's pages a rank maps: shm maps it whole, MAP_POPULATE)")
    if result["gather_over_shards"]:
        lines.append(f"gather / shards (staged, medians): {result['gather_over_shards']:.1f}x")
    return "\n".join(lines)
