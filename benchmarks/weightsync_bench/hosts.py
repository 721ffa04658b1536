"""Internal. ``weightsync bench --hosts N``: the benchmark between hosts that share nothing, on this
machine: hostnet.Cluster builds N hosts (network namespaces on a bridge, each with its own
address, /dev/shm, /tmp and Ray node), each link limited to ``--link-gbit`` both ways. The rows
run inside host 0 (hosts_job.py); this process answers its reads of the links' counters,
prints the table and writes the JSON. Needs root.

Every figure is a ratio to the link: ``x link`` is a version's seconds over the link time of
one payload (payload x 8 / rate), ``payloads out of host 0`` the bytes host 0's link sent
during the timed versions over payload x versions.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

from .hostnet import Cluster, available

LAYOUT = "link-128m"
# what each weightsync row sets in its session's config; the other rows are baselines
SESSIONS: dict[str, dict[str, Any]] = {
    "relay": {"transport": "relay"},
    "broadcast": {"transport": "broadcast"},
    "relay+delta": {"transport": "relay", "delta": "on"},
    "auto": {"transport": "auto"},
}
BASELINES = ("ray-numpy", "ray-rdt-gloo")
ROWS = (*SESSIONS, *BASELINES)


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("between isolated hosts (root only)")
    g.add_argument("--hosts", type=int, default=None, metavar="N",
                   help="run the rows between N hosts built on this machine (network namespaces on a bridge, "
                        "each with its own /dev/shm and Ray node): trainer on host 0, rollouts on the others "
                        f"(layout {LAYOUT} unless --model says otherwise)")
    g.add_argument("--link-gbit", type=float, default=2.0, metavar="G", help="each host's link rate, both ways")
    g.add_argument("--cases", nargs="+", default=None, metavar="HxK",
                   help="H receiving hosts x K rollouts each (default: 1x1 and (N-1)x2)")
    g.add_argument("--host-rows", nargs="+", default=["relay", "broadcast", "relay+delta", "ray-numpy",
                                                      "ray-rdt-gloo"], choices=ROWS, metavar="ROW",
                   help=f"rows between the hosts: {', '.join(ROWS)} (relay+delta runs delta: on; the "
                        "update model is --update, adamw-1e-6 by default here)")


def _cases(args: argparse.Namespace) -> list[tuple[int, int]]:
    spelled = args.cases or ["1x1", f"{args.hosts - 1}x2"]
    out = []
    for c in dict.fromkeys(spelled):
        try:
            h, k = (int(x) for x in c.lower().split("x"))
        except ValueError:
            raise SystemExit(f"weightsync bench: --cases {c!r} is not HxK") from None
        if not (1 <= h < args.hosts and k >= 1):
            raise SystemExit(f"weightsync bench: --cases {c}: 1 <= H < --hosts ({args.hosts}) and K >= 1")
        out.append((h, k))
    return out


def _stats(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)} if xs else {}


def summarize(result: dict[str, Any], gbit: float) -> list[dict[str, Any]]:
    """One line per case and row: its versions' seconds over every round, x the link time of
    one payload, the payloads each host's link carried per version."""
    payload = result["payload"]
    link_s = payload * 8 / (gbit * 1e9)
    lines = []
    for case in result["cases"]:
        for row, rounds in case["rows"].items():
            errors = [r["error"] for r in rounds if "error" in r]
            seconds = [s for r in rounds if "error" not in r for s in r["seconds"]]
            per_round = [r for r in rounds if "error" not in r]
            line: dict[str, Any] = {"case": case["case"], "row": row, "rounds": len(rounds), "errors": errors,
                                    "verified": bool(per_round) and all(r["verified"] for r in per_round)}
            if seconds:
                st = _stats(seconds)
                line.update(seconds=st, x_link=st["median"] / link_s, link_rate=link_s / st["median"],
                            spread=(st["max"] - st["min"]) / st["median"])
                hosts = len(per_round[0]["links"])
                versions = len(per_round[0]["seconds"])
                line["payloads_sent"] = [statistics.median(r["links"][h][0] / (payload * versions)
                                                           for r in per_round) for h in range(hosts)]
                line["payloads_received"] = [statistics.median(r["links"][h][1] / (payload * versions)
                                                               for r in per_round) for h in range(hosts)]
                if per_round[0].get("changed_fraction"):
                    line["changed_fraction"] = statistics.median(f for r in per_round for f in r["changed_fraction"])
                if per_round[0].get("transport"):
                    line["transport"] = per_round[0]["transport"]
            lines.append(line)
    return lines


def verdict(lines: list[dict[str, Any]]) -> dict[str, Any]:
    """The ratios the rows exist for, where both sides ran: more hosts against one (relay), the
    sender's link, delta against full, relay against what a user would pick instead."""
    at = {(ln["case"], ln["row"]): ln for ln in lines if "seconds" in ln}
    cases = list(dict.fromkeys(ln["case"] for ln in lines))
    out: dict[str, Any] = {}
    one, many = cases[0], cases[-1]

    def med(case: str, row: str) -> float | None:
        got = at.get((case, row))
        return got["seconds"]["median"] if got else None

    if med(one, "relay"):
        out["relay_link_rate_one_host"] = at[(one, "relay")]["link_rate"]
    if many != one and med(one, "relay") and med(many, "relay"):
        out[f"relay_{many}_over_{one}"] = med(many, "relay") / med(one, "relay")
        out[f"relay_{many}_payloads_out_of_host_0"] = at[(many, "relay")]["payloads_sent"][0]
    for case in cases:
        for row, key in (("relay+delta", "delta_speedup"), ("ray-numpy", "over_ray_object_store"),
                         ("ray-rdt-gloo", "over_ray_rdt_gloo"), ("broadcast", "over_broadcast")):
            base, ours = (med(case, "relay"), med(case, row)) if row == "relay+delta" else \
                (med(case, row), med(case, "relay"))
            if base and ours:
                out[f"{case}_{key}"] = base / ours
    return out


def table(lines: list[dict[str, Any]], gbit: float, payload: int) -> str:
    rows = [f"payload {payload / 2**20:.0f} MiB, links {gbit:g} Gbit/s both ways: link time "
            f"{payload * 8 / (gbit * 1e9):.3f} s per payload",
            f"{'case':<6} {'row':<13} {'s/version (min-max)':<24} {'x link':>7} {'out of h0':>10} "
            f"{'changed':>8}  verified"]
    for ln in lines:
        if "seconds" not in ln:
            rows.append(f"{ln['case']:<6} {ln['row']:<13} failed: {'; '.join(ln['errors'])[:300]}")
            continue
        s = ln["seconds"]
        changed = f"{100 * ln['changed_fraction']:.1f}%" if "changed_fraction" in ln else "-"
        rows.append(f"{ln['case']:<6} {ln['row']:<13} {s['median']:.3f} ({s['min']:.3f}-{s['max']:.3f}){'':<4} "
                    f"{ln['x_link']:>7.2f} {ln['payloads_sent'][0]:>10.2f} {changed:>8}  "
                    f"{'yes' if ln['verified'] else 'NO'}{' (' + str(len(ln['errors'])) + ' failed)' if ln['errors'] else ''}")
    return "\n".join(rows)


def _plan(args: argparse.Namespace) -> dict[str, Any]:
    from weightsync.config import SyncConfig

    bucket = args.bucket_mb[0] if getattr(args, "bucket_mb", None) else SyncConfig().bucket_mb
    return {"model": args.model[0], "update": args.update if args.update != "random" else "adamw-1e-6",
            "cases": _cases(args), "rows": list(dict.fromkeys(args.host_rows)), "rounds": args.rounds,
            "versions": args.versions, "warmup": max(2, args.warmup),
            "config": {"bucket_mb": bucket, "device": "cpu", "sync_timeout_s": 120.0}}


def run(args: argparse.Namespace) -> int:
    ok, why = available()
    if not ok:
        print(f"weightsync bench --hosts: cannot build isolated hosts here: {why}", file=sys.stderr)
        return 2
    if args.hosts < 2:
        raise SystemExit("weightsync bench: --hosts needs at least 2 (host 0 sends)")
    plan = _plan(args)
    from .layouts import layout

    payload = layout(plan["model"]).total_bytes
    most = max(h * k for h, k in plan["cases"])
    # each host's /dev/shm holds Ray's store (a few versions for ray-numpy) and the relay's segments
    store_mb = int(4 * payload / 2**20) + 256
    shm_mb = store_mb + int(6 * payload / 2**20) + 256
    started = time.time()
    with Cluster(hosts=args.hosts, link_gbit=args.link_gbit, shm_mb=shm_mb, object_store_mb=store_mb,
                 num_cpus=max(2, most + 2), env=cluster_env()) as cluster:
        result = drive(cluster, plan)
    leftovers = cluster.leftovers()
    if "error" in result:
        print(f"weightsync bench --hosts: the job failed: {result['error']}\n{result.get('trace', '')}",
              file=sys.stderr)
        return 1
    lines = summarize(result, args.link_gbit)
    out = {"schema": "weightsync.bench-hosts/1", "started": started, "seconds": time.time() - started,
           "hosts": args.hosts, "link_gbit": args.link_gbit, "plan": plan, "payload": result["payload"],
           "rows": lines, "verdict": verdict(lines), "raw": result, "leftovers": leftovers,
           "note": getattr(args, "note", "")}
    print(table(lines, args.link_gbit, result["payload"]))
    for key, value in out["verdict"].items():
        print(f"{key}: {value:.2f}")
    if getattr(args, "json", None):
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    if leftovers:
        print(f"weightsync bench --hosts: left behind: {leftovers}", file=sys.stderr)
        return 1
    return 0 if all(ln["verified"] and not ln["errors"] for ln in lines) else 1


def cluster_env() -> dict[str, str]:
    """What every process of the bench's cluster needs: this process's weightsync and bench on
    its path, gloo on the host's own interface."""
    import weightsync
    import weightsync_bench

    # where this process found both packages (a clone's checkout, or the installed ones)
    roots = {os.path.dirname(os.path.dirname(m.__file__)) for m in (weightsync, weightsync_bench)}
    # gloo (Ray's collective group, and ours) binds the host's own interface, as on a cluster
    # whose hostname resolves to no routable address
    return {"PYTHONPATH": os.pathsep.join(sorted(roots)), "GLOO_SOCKET_IFNAME": "eth0"}


def drive(cluster: Cluster, plan: dict[str, Any], timeout: float = 3600.0,
           job: str = "weightsync_bench.hosts_job") -> dict[str, Any]:
    """The job (a module) inside host 0: answer its reads of the links' counters until its RESULT."""
    proc = cluster.run(0, [cluster.python, "-u", "-m", job],
                       env={"WS_BENCH_PLAN": json.dumps(plan)}, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue = queue.Queue()

    def read() -> None:
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    end = time.monotonic() + timeout
    tail: list[str] = []
    while True:
        try:
            line = lines.get(timeout=max(0.1, end - time.monotonic()))
        except queue.Empty:
            return {"error": f"no result within {timeout:.0f} s", "trace": "".join(tail[-40:])}
        if line is None:
            return {"error": "the job ended without a result", "trace": "".join(tail[-40:])}
        if line.startswith("ASK "):
            links = [list(cluster.link_bytes(h)) for h in range(cluster.hosts)]
            proc.stdin.write(json.dumps({"links": links}) + "\n")
            proc.stdin.flush()
        elif line.startswith("RESULT "):
            return json.loads(line[7:])
        elif line.startswith("PROGRESS "):
            print(line[9:].rstrip(), file=sys.stderr, flush=True)
        else:
            tail.append(line)
