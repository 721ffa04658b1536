"""How should a gloo broadcast transport carry every trainer rank's rows to the rollout hosts?

    python benchmarks/bcast_schedule.py [--link-gbit 1] [--rounds 6] [--json PATH] [--txt PATH]

Root (network namespaces). Torch only: no weightsync, no Ray. In a sharded session every trainer
rank sends its own rows of each bucket; with gloo there are two obvious ways to put them on the
wire, and which one the broadcast transport should use is a question of what gloo does with
them between hosts, so this probe measures both beside a one-sender reference.

Isolated hosts (``hostnet.Cluster(hosts=4, ray=False)``: network namespaces on a bridge, each
link ``--link-gbit`` both ways): hosts 0 and 1 are trainer hosts with 2 processes each (trainer
ranks 0-3), hosts 2 and 3 rollout hosts with one receiver each (global ranks 4 and 5). Every
process builds its gloo groups directly (ProcessGroupGloo on a PrefixStore of one TCPStore
hosted by rank 0, device eth0). The payload (128 MiB) goes in 16 MiB buckets, each split into 4
pieces: rank r owns piece r (4 MiB) of every bucket. Schemes, each with two buckets in flight
(async ops; the works of bucket b-2 are waited for before bucket b is posted):

  A  per-rank groups  4 groups, group r = [rank r (root), receiver 0, receiver 1]; every rank
                      broadcasts its pieces on its own group, all ranks at once; receivers post,
                      for each bucket, one broadcast per rank group
  B  rank-ordered     one group of all 6; for each bucket the pieces are broadcast from src
                      0, 1, 2, 3 in order (the other trainer ranks receive them too)
  C  one sender       reference: rank 0 broadcasts whole 16 MiB buckets on [rank 0, receiver 0,
                      receiver 1]: what a gathered version costs on the wire, without the gather

A version's time runs from a barrier of all 6 processes (a group of all) until the process is
done (receivers: every piece in; senders: every broadcast complete); the version's figure is
the max over processes. Receivers zero their payload before a version and compare it with the
expected pattern (bit-exact, every version) after it, outside the timed part. Bytes out of and
into each host's link per version (``Cluster.link_bytes``, the kernel's veth counters: TCP/IP
headers included) are given in payloads. One warm-up version per scheme, then ``--rounds``
rounds of A, B, C with the order rotated each round.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from typing import Any

MiB = 1 << 20
RANKS, RECEIVERS = 4, 2
WORLD = RANKS + RECEIVERS
SCHEMES = {"A": "per-rank groups", "B": "rank-ordered", "C": "one sender (reference)"}
STORE_PORT = 29611
WINDOW = 2  # buckets in flight


def host_of(rank: int) -> int:
    """Trainer ranks 0, 1 on host 0 and 2, 3 on host 1; receivers 4, 5 on hosts 2, 3."""
    return rank // 2 if rank < RANKS else 2 + (rank - RANKS)


# -- a process of the cluster ----------------------------------------------------------------

def _key(version: int) -> int:
    return ((version + 1) * 0x01000193) & 0x7FFFFFFF


def _pattern(version: int, start: int, count: int) -> Any:
    """The payload's int32 words [start, start + count) in ``version``: each word its index
    xor a key of the version (every word differs from its neighbours and from other versions)."""
    import torch
    return torch.arange(start, start + count, dtype=torch.int32).bitwise_xor_(_key(version))


def worker(rank: int, store_host: str, payload_mb: int, bucket_mb: int, timeout_s: float) -> None:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    words, bucket = payload_mb * MiB // 4, bucket_mb * MiB // 4
    piece, nb = bucket // RANKS, words // bucket
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(store_host, STORE_PORT, WORLD, rank == 0, timeout=timeout, wait_for_workers=False)
    device = dist.ProcessGroupGloo.create_device(interface="eth0")

    def group(name: str, members: list[int]) -> Any:
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [device]
        return dist.ProcessGroupGloo(dist.PrefixStore(name, store), members.index(rank), len(members), opts)

    receiver = rank >= RANKS
    every = group("all", list(range(WORLD)))  # scheme B and the barrier
    per_rank = {r: group(f"A{r}", [r, 4, 5]) for r in range(RANKS) if receiver or r == rank}
    one = group("C", [0, 4, 5]) if receiver or rank == 0 else None

    out = torch.zeros(words, dtype=torch.int32) if receiver else None
    shard = None if receiver else torch.empty(nb * piece, dtype=torch.int32)  # piece `rank` of each bucket
    scratch = None if receiver else torch.empty(WINDOW, bucket, dtype=torch.int32)  # others' pieces (B)
    full = torch.empty(words, dtype=torch.int32) if rank == 0 else None  # rank 0's whole payload (C)

    def bcast(pg: Any, t: Any, root: int) -> Any:
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        return pg.broadcast([t], opts)

    def piece_view(b: int, r: int) -> Any:
        """Where piece r of bucket b goes or comes from on this process."""
        if receiver:
            return out[b * bucket + r * piece:][:piece]
        if r == rank:
            return shard[b * piece:][:piece]
        return scratch[b % WINDOW][r * piece:][:piece]

    def post(scheme: str, b: int) -> list[Any]:
        if scheme == "A":
            return [bcast(pg, piece_view(b, r), 0) for r, pg in per_rank.items()]
        if scheme == "B":
            return [bcast(every, piece_view(b, r), r) for r in range(RANKS)]
        if one is None:
            return []
        return [bcast(one, (out if receiver else full)[b * bucket:][:bucket], 0)]

    def version(scheme: str, v: int) -> dict[str, Any]:
        if receiver:
            out.zero_()
        else:
            for b in range(nb):
                shard[b * piece:][:piece].copy_(_pattern(v, b * bucket + rank * piece, piece))
            if full is not None and scheme == "C":
                full.copy_(_pattern(v, 0, words))
        every.barrier().wait()
        t0 = time.perf_counter()
        works: list[list[Any]] = []
        for b in range(nb):
            if b >= WINDOW:
                for w in works[b - WINDOW]:
                    w.wait()
            works.append(post(scheme, b))
        for ws in works[-WINDOW:]:
            for w in ws:
                w.wait()
        elapsed = time.perf_counter() - t0
        ok = bool(torch.equal(out, _pattern(v, 0, words))) if receiver else None
        return {"rank": rank, "s": elapsed, "ok": ok}

    print(json.dumps({"rank": rank, "ready": True}), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "quit":
            break
        try:
            print(json.dumps(version(cmd[0], int(cmd[1]))), flush=True)
        except Exception as exc:  # the driver reports it and stops
            print(json.dumps({"rank": rank, "error": repr(exc)}), flush=True)
            raise


# -- the driver ------------------------------------------------------------------------------

def _spread(xs: list[float]) -> dict[str, float]:
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0]] * 3
    return {"median_s": statistics.median(xs), "min_s": min(xs), "max_s": max(xs),
            "q1_s": q[0], "q3_s": q[2], "iqr_s": q[2] - q[0]}


def schedule(rounds: int, warmup: int) -> list[tuple[str, bool]]:
    """(scheme, warm-up?) in the order run: warm-up versions of each scheme, then ``rounds``
    rounds of every scheme, the order rotated by one each round."""
    names = list(SCHEMES)
    out = [(s, True) for _ in range(warmup) for s in names]
    for i in range(rounds):
        k = i % len(names)
        out += [(s, False) for s in names[k:] + names[:k]]
    return out


class _Lines:
    """A worker's stdout lines, read by a thread, handed out with a timeout."""

    def __init__(self, proc: subprocess.Popen):
        self.q: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, args=(proc,), daemon=True).start()

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            self.q.put(line)
        self.q.put("")

    def get(self, timeout: float) -> dict[str, Any]:
        line = self.q.get(timeout=timeout)
        if not line:
            raise RuntimeError("a worker exited")
        return json.loads(line)


def measure(link_gbit: float, rounds: int, warmup: int, payload_mb: int, bucket_mb: int,
            timeout_s: float, log_dir: str) -> dict[str, Any]:
    from weightsync_bench.hostnet import Cluster
    payload = payload_mb * MiB
    hosts = 4
    versions: list[dict[str, Any]] = []
    with Cluster(hosts=hosts, link_gbit=link_gbit, ray=False, shm_mb=64, tmp_mb=64,
                 env={"GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1"}) as cluster:
        procs, lines = [], []
        for rank in range(WORLD):
            err = open(os.path.join(log_dir, f"rank{rank}.log"), "w")
            p = cluster.run(host_of(rank), [sys.executable, os.path.abspath(__file__), "--worker", str(rank),
                                             "--store-host", cluster.address(0), "--payload-mb", str(payload_mb),
                                             "--bucket-mb", str(bucket_mb), "--timeout-s", str(timeout_s)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True)
            err.close()
            procs.append(p)
            lines.append(_Lines(p))
        for ln in lines:
            ln.get(timeout_s)
        for v, (scheme, warm) in enumerate(schedule(rounds, warmup)):
            before = [cluster.link_bytes(h) for h in range(hosts)]
            for p in procs:
                p.stdin.write(f"{scheme} {v}\n")
                p.stdin.flush()
            got = [ln.get(timeout_s) for ln in lines]
            after = [cluster.link_bytes(h) for h in range(hosts)]
            bad = [g for g in got if "error" in g]
            if bad:
                raise RuntimeError(f"version {v} ({scheme}): {bad}")
            rec = {"version": v, "scheme": scheme, "warmup": warm, "s": max(g["s"] for g in got),
                   "senders_s": max(g["s"] for g in got if g["rank"] < RANKS),
                   "receivers_s": max(g["s"] for g in got if g["rank"] >= RANKS),
                   "per_rank_s": [round(g["s"], 4) for g in got],
                   "bit_exact": [g["ok"] for g in got if g["rank"] >= RANKS],
                   "out_payloads": [(a[0] - b[0]) / payload for a, b in zip(after, before)],
                   "in_payloads": [(a[1] - b[1]) / payload for a, b in zip(after, before)]}
            versions.append(rec)
            print(f"  v{v:2d} {scheme}{' (warm-up)' if warm else ''}: {rec['s']:.3f} s, bit-exact {rec['bit_exact']}, "
                  f"out {[round(x, 2) for x in rec['out_payloads']]}, in {[round(x, 2) for x in rec['in_payloads']]}",
                  file=sys.stderr, flush=True)
        for p in procs:
            p.stdin.write("quit\n")
            p.stdin.flush()
        for p in procs:
            p.wait(timeout=30)
        left = cluster
    left_after = left.leftovers()
    link_s = payload * 8 / (link_gbit * 1e9)
    rows = {}
    for s, name in SCHEMES.items():
        timed = [r for r in versions if r["scheme"] == s and not r["warmup"]]
        row = {"name": name, **_spread([r["s"] for r in timed])}
        row["x_link"] = row["median_s"] / link_s
        row["senders_median_s"] = statistics.median(r["senders_s"] for r in timed)
        row["receivers_median_s"] = statistics.median(r["receivers_s"] for r in timed)
        row["versions"] = len(timed)
        row["every_version_bit_exact"] = all(all(r["bit_exact"]) for r in versions if r["scheme"] == s)
        row["out_payloads_median"] = [statistics.median(r["out_payloads"][h] for r in timed) for h in range(hosts)]
        row["in_payloads_median"] = [statistics.median(r["in_payloads"][h] for r in timed) for h in range(hosts)]
        rows[s] = row
    return {"link_s": link_s, "rows": rows, "versions": versions, "leftovers_after_close": left_after}


def format_result(r: dict[str, Any]) -> str:
    c = r["config"]
    lines = [f"bcast_schedule: {c['payload_mb']} MiB in {c['bucket_mb']} MiB buckets, 4 trainer ranks on hosts 0-1 "
             f"(2 each), receivers on hosts 2, 3, links {c['link_gbit']} Gbit/s; link time of one payload "
             f"{r['link_s']:.3f} s; {c['rounds']} rounds after {c['warmup']} warm-up per scheme",
             f"{'scheme':<28} {'median s':>8} {'min-max s':>13} {'IQR s':>6} {'x link':>6}  "
             f"{'payloads out h0,h1 / in h2,h3':<30} {'out h2,h3':<10} bit-exact"]
    for s, row in r["rows"].items():
        o, i = row["out_payloads_median"], row["in_payloads_median"]
        lines.append(f"{s} {row['name']:<26} {row['median_s']:8.3f} {row['min_s']:6.3f}-{row['max_s']:6.3f} "
                     f"{row['iqr_s']:6.3f} {row['x_link']:6.2f}  {o[0]:.2f}, {o[1]:.2f} / {i[2]:.2f}, {i[3]:.2f}"
                     f"{'':<13} {o[2]:.2f}, {o[3]:.2f} {'yes' if row['every_version_bit_exact'] else 'NO'}")
    rows = r["rows"]
    lines.append(f"B / A {rows['B']['median_s'] / rows['A']['median_s']:.2f}x, "
                 f"C / A {rows['C']['median_s'] / rows['A']['median_s']:.2f}x (medians)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--link-gbit", type=float, default=1.0)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--payload-mb", type=int, default=128)
    p.add_argument("--bucket-mb", type=int, default=16)
    p.add_argument("--timeout-s", type=float, default=120.0)
    p.add_argument("--json", help="write the result here")
    p.add_argument("--txt", help="write the table here")
    p.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    p.add_argument("--store-host", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker is not None:
        worker(a.worker, a.store_host, a.payload_mb, a.bucket_mb, a.timeout_s)
        return 0
    if a.payload_mb * MiB % (a.bucket_mb * MiB) or a.bucket_mb * MiB % (4 * RANKS):
        p.error("the payload must be whole buckets, a bucket 4 whole pieces of int32 words")
    import torch
    started = time.time()
    info = {"cpu_model": next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if
                               ln.startswith("model name")), platform.machine()),
            "cpu_count": os.cpu_count(), "load_avg_start": list(os.getloadavg()), "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__}
    with tempfile.TemporaryDirectory(prefix="bcast-schedule-") as logs:
        try:
            r = measure(a.link_gbit, a.rounds, a.warmup, a.payload_mb, a.bucket_mb, a.timeout_s, logs)
        except BaseException:
            for name in sorted(os.listdir(logs)):
                with open(os.path.join(logs, name)) as f:
                    print(f"--- {name}\n{f.read()[-3000:]}", file=sys.stderr)
            raise
    info["load_avg_end"] = list(os.getloadavg())
    r = {"probe": "bcast_schedule", "argv": sys.argv[1:] if argv is None else argv, "machine": info,
         "config": {"link_gbit": a.link_gbit, "rounds": a.rounds, "warmup": a.warmup, "payload_mb": a.payload_mb,
                    "bucket_mb": a.bucket_mb, "ranks": RANKS, "receivers": RECEIVERS, "window": WINDOW,
                    "hosts": {str(k): host_of(k) for k in range(WORLD)}},
         "schemes": SCHEMES, "wall_s": time.time() - started, **r}
    text = format_result(r)
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=1)
    if a.txt:
        with open(a.txt, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
