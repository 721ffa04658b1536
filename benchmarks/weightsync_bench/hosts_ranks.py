"""Internal. ``weightsync bench --hosts N --trainer-ranks HxR``: sharded sending between hosts that
share nothing (issue 56's multi-host target). hostnet.Cluster builds N hosts, each link limited
to ``--link-gbit`` both ways; H of them are trainer hosts of R ranks each (one gloo group over
all H x R ranks, FSDP2-style ``Shard(0)`` DTensors on a 1-D CPU mesh spanning the hosts), the
other N - H receive, ``--receivers`` K each (default 1), transport relay. The rows (``gather``:
``full_tensor()`` on every rank, rank 0 sends whole tensors; ``shards``: every rank passes its
local DTensors; ``shards-broadcast``: the same on transport broadcast over gloo; beside them what a Ray user writes instead, ``ray-numpy``: every rank puts its
rows into Ray's object store, every receiver gets all of them and joins the rows, and
``ray-rdt-gloo``: the same over Ray Direct Transport) run inside
host 0 (hosts_ranks_job.py); this process answers the job's reads of the links' counters
(hosts.drive), prints the table and writes the JSON.

Figures per row, over its timed versions: the seconds from the barrier ending the update until
rank 0's sync() returned (the baselines: until the last receiver loaded; ray-rdt-gloo from the
driver's call, its ranks already stepped), their median and spread, ``x link`` (seconds over the link time of one
payload: payload x 8 / rate), and per host the bytes its link sent and received per version as
payloads; every version, warm-up included, checked bit-exact on every receiver.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import sys
import time
from typing import Any

from .hostnet import Cluster, available

# /2: baseline rows beside the sessions (ray-numpy, ray-rdt-gloo): a row's "kind" (weightsync /
# baseline), a baseline's transport null and its versions' barrier_s / ranks_synced_s null (and
# staged_s: ray-numpy the time of rank 0's put, ray-rdt-gloo null); "over_shards" per row
SCHEMA = "weightsync.bench-hosts-ranks/2"
BASELINES = ("ray-numpy", "ray-rdt-gloo")
WHAT = {"gather": "full_tensor() on every rank (a generator passed to stage()), rank 0 sends whole tensors",
        "shards": "every rank passes its local DTensors to stage(); relay taking rows, each rank sends its own "
                  "rows to each head (a receiving host per trainer host)",
        "shards-broadcast": "every rank passes its local DTensors to stage(); broadcast (gloo) taking rows, each rank "
                            "broadcasts its own rows over a group of its own to every receiver",
        "ray-numpy": "every rank ray.put()s its rows as numpy, each receiver ray.get()s every rank's refs, joins "
                     "the rows into whole tensors and loads them",
        "ray-rdt-gloo": "every rank's method returns its rows over Ray Direct Transport (gloo), each receiver "
                        "takes every rank's ref, joins the rows and loads them (parties of its own)"}


def _plan(args: argparse.Namespace) -> dict[str, Any]:
    trainer_hosts, per_host = args.trainer_ranks
    if trainer_hosts * per_host < 2:
        raise SystemExit("weightsync bench: --trainer-ranks needs at least 2 ranks (a mesh of one is not sharded)")
    if args.hosts <= trainer_hosts:
        raise SystemExit(f"weightsync bench: --hosts {args.hosts} leaves no receiving host beside "
                         f"{trainer_hosts} trainer host(s)")
    receivers = max(args.receivers)
    if receivers < 1:
        raise SystemExit("weightsync bench: --receivers must be >= 1")
    if args.versions < 1 or args.rounds < 1 or args.warmup < 0:
        raise SystemExit("weightsync bench: --versions and --rounds must be >= 1, --warmup >= 0")
    return {"model": args.model[0], "dtype": args.dtype or "bfloat16", "trainer_hosts": trainer_hosts,
            "ranks_per_host": per_host, "receiving_hosts": list(range(trainer_hosts, args.hosts)),
            "receivers_per_host": receivers, "rounds": args.rounds, "versions": args.versions,
            "warmup": args.warmup, "link_bits": args.link_gbit * 1e9,
            "config": {"transport": "relay", "device": "cpu", "bucket_mb": args.bucket_mb[0],
                       "checksum": args.checksum[0] == "on", "digest": args.digest,
                       # throughput, not liveness, is measured: a busy machine must not abort a version
                       "sync_timeout_s": 300.0, "connect_timeout_s": 120.0, "heartbeat_timeout_s": 60.0}}


def _commit() -> str | None:
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        out = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def run(args: argparse.Namespace) -> int:
    ok, why = available()
    if not ok:
        print(f"weightsync bench --hosts --trainer-ranks: cannot build isolated hosts here: {why}", file=sys.stderr)
        return 2
    from . import results
    from .hosts import cluster_env, drive
    from .layouts import layout

    plan = _plan(args)
    payload = layout(plan["model"], plan["dtype"]).total_bytes
    # each host's /dev/shm: Ray's store (the ray-numpy row's rows: a version's on the trainer
    # hosts, whole versions pulled to the receiving hosts) and relay's segments (two slots per
    # session, two sessions, on every receiving host)
    store_mb = int(2 * payload / 2**20) + 256
    shm_mb = store_mb + int(6 * payload / 2**20) + 256
    started, machine = time.time(), results.machine_info()
    with Cluster(hosts=args.hosts, link_gbit=args.link_gbit, shm_mb=shm_mb, object_store_mb=store_mb,
                 num_cpus=2, env=cluster_env()) as cluster:
        raw = drive(cluster, plan, job="weightsync_bench.hosts_ranks_job")
    leftovers = cluster.leftovers()
    if "error" in raw:
        print(f"weightsync bench --hosts --trainer-ranks: the job failed: {raw['error']}\n{raw.get('trace', '')}",
              file=sys.stderr)
        return 1
    out = result(args, plan, raw, machine, started, leftovers)
    print(table(out))
    if getattr(args, "json", None):
        results.write_json(out, args.json)
        print(f"wrote {args.json}", file=sys.stderr)
    if leftovers:
        print(f"weightsync bench --hosts --trainer-ranks: left behind: {leftovers}", file=sys.stderr)
        return 1
    return 0 if all(r["verified"] and not r["error"] for r in out["rows"]) else 1


def summarize(name: str, got: dict[str, Any], payload: int, link_s: float, trainer_hosts: list[int],
              receiving_hosts: list[int]) -> dict[str, Any]:
    """One row from its versions: the timed ones' seconds (median, spread, x link) and bytes per
    link as payloads (median over the timed versions, per host), bit-exactness over all."""
    from .rounds import spread

    versions = got["versions"]
    timed = [v for v in versions if v["round"] >= 0]
    seconds = [v["seconds"] for v in timed]
    st = spread(seconds)
    hosts = len(versions[0]["links"]) if versions else 0

    def per_host(way: int) -> list[float | None]:
        return [statistics.median(v["links"][h][way] / payload for v in timed) if timed else None
                for h in range(hosts)]

    sent, received = per_host(0), per_host(1)
    line: dict[str, Any] = {
        "name": name, "kind": "baseline" if name in BASELINES else "weightsync", "what": WHAT[name],
        "error": got["error"], "transport": got["transport"],
        "transport_reason": got["transport_reason"],
        # every version, warm-up too, bit-exact on every receiver
        "verified": bool(timed) and all(all(v["bit_exact"]) for v in versions),
        "sharded": versions[-1]["sharded"] if versions else [],
        "seconds": seconds, **st, "max_s": max(seconds) if seconds else None,
        "x_link": st["median_s"] / link_s if seconds else None,
        "x_link_min": min(seconds) / link_s if seconds else None,
        "x_link_max": max(seconds) / link_s if seconds else None,
        "staged_s": statistics.median(staged) if (staged := [v["staged_s"] for v in timed
                                                              if v["staged_s"] is not None]) else None,
        "payloads_sent": sent, "payloads_received": received,
        "trainer_hosts_out": [sent[h] for h in trainer_hosts] if timed else [],
        "receiving_hosts_in": [received[h] for h in receiving_hosts] if timed else [],
        "versions": versions,
    }
    return line


def result(args: argparse.Namespace, plan: dict[str, Any], raw: dict[str, Any], machine: dict, started: float,
           leftovers: list[str]) -> dict[str, Any]:
    payload = raw["payload"]
    link_s = payload * 8 / plan["link_bits"]
    trainer_hosts = list(range(plan["trainer_hosts"]))
    rows = [summarize(name, got, payload, link_s, trainer_hosts, plan["receiving_hosts"])
            for name, got in raw["rows"].items()]
    by = {r["name"]: r for r in rows}
    g, s = (by.get(n, {}).get("median_s") for n in ("gather", "shards"))
    for r in rows:  # each row's median over the shards row's: how much slower than sending shards
        r["over_shards"] = r["median_s"] / s if r["median_s"] and s else None
    return {
        "schema": SCHEMA, "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "wall_s": time.time() - started, "note": getattr(args, "note", ""), "commit": _commit(),
        "machine": {**machine, "load_avg_end": list(os.getloadavg())},
        "args": {"model": plan["model"], "dtype": plan["dtype"], "hosts": args.hosts,
                 "trainer_hosts": plan["trainer_hosts"], "ranks_per_host": plan["ranks_per_host"],
                 "receiving_hosts": plan["receiving_hosts"], "receivers_per_host": plan["receivers_per_host"],
                 "link_gbit": args.link_gbit, "transport": "relay", "bucket_mb": plan["config"]["bucket_mb"],
                 "checksum": plan["config"]["checksum"], "rounds": plan["rounds"], "versions": plan["versions"],
                 "warmup": plan["warmup"]},
        "layout": {"name": plan["model"], "tensors": raw["tensors"], "uneven": raw["uneven"]},
        "payload_bytes": payload, "link_s": link_s, "rank_bytes": raw["rank_bytes"],
        # each trainer host's part of the payload: its ranks' rows, what it sends when no rank gathers
        "trainer_host_share": [sum(n for n, h in zip(raw["rank_bytes"], raw["hosts_of"]["ranks"]) if h == host) / payload
                               for host in trainer_hosts],
        "placement": {"master": raw["master"], "rank_hosts": raw["hosts_of"]["ranks"],
                      "receiver_hosts": raw["hosts_of"]["receivers"]},
        "rows": rows, "gather_over_shards": g / s if g and s else None, "leftovers": leftovers,
    }


def table(out: dict[str, Any]) -> str:
    a = out["args"]
    th, rh = list(range(a["trainer_hosts"])), a["receiving_hosts"]
    lines = [f"weightsync bench --hosts {a['hosts']} --trainer-ranks {a['trainer_hosts']}x{a['ranks_per_host']}: "
             f"{a['model']} ({out['payload_bytes'] / 2**20:.0f} MiB, {out['layout']['tensors']} tensors"
             f"{', uneven shards' if out['layout']['uneven'] else ''}), relay, {a['trainer_hosts']} trainer host(s) x "
             f"{a['ranks_per_host']} ranks, {len(rh)} receiving host(s) x {a['receivers_per_host']}, "
             f"{a['bucket_mb']:g} MiB buckets, {a['rounds']} rounds x {a['versions']} versions (after {a['warmup']} "
             f"warm-up)",
             f"links {a['link_gbit']:g} Gbit/s both ways: link time {out['link_s']:.3f} s per payload; each trainer "
             f"host's rows: {' '.join(f'{x:.2f}' for x in out['trainer_host_share'])} payloads",
             "clock: from the barrier ending the update on every rank until rank 0's sync() returned (every receiver "
             "committed; ray-numpy: until the last receiver loaded; ray-rdt-gloo: from the driver's call, its ranks "
             "stepped, until the last receiver loaded); bytes: each link's counters per version, over the payload",
             f"{'row':<16} {'median s':>8} {'min-max s':>13} {'IQR s':>6} {'x link':>7}  "
             f"{'payloads out of ' + ' '.join(f'h{h}' for h in th):<22} {'into ' + ' '.join(f'h{h}' for h in rh):<14} "
             f"{'sharded':<8} bits"]
    for r in out["rows"]:
        if not r["seconds"]:
            lines.append(f"{r['name']:<16} FAILED: {r['error']}")
            continue
        sharded = "yes" if r["sharded"] and all(r["sharded"]) else "no"
        lines.append(f"{r['name']:<16} {r['median_s']:>8.3f} {r['min_s']:>6.3f}-{r['max_s']:<6.3f} {r['iqr_s']:>6.3f} "
                     f"{r['x_link']:>7.2f}  {' '.join(f'{x:.2f}' for x in r['trainer_hosts_out']):<22} "
                     f"{' '.join(f'{x:.2f}' for x in r['receiving_hosts_in']):<14} {sharded:<8} "
                     f"{'ok' if r['verified'] else 'DIFF'}" + (f"  FAILED later: {r['error']}" if r["error"] else ""))
    for r in out["rows"]:
        if r["transport_reason"]:
            lines.append(f"{r['name']}: transport {r['transport']} ({r['transport_reason']})")
    over = [f"{r['name']} {r['over_shards']:.2f}x" for r in out["rows"] if r["name"] != "shards" and r["over_shards"]]
    if over:
        lines.append(f"over shards (medians): {', '.join(over)}")
    return "\n".join(lines)
