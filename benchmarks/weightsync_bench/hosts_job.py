"""Internal. The rows of ``weightsync bench --hosts``, run inside host 0 of a hostnet.Cluster as
``python -m weightsync_bench.hosts_job`` (hosts.py starts it and passes the plan as JSON in
``WS_BENCH_PLAN``). The trainer and each row's coordinator run on host 0, the rollouts on hosts
1.., each party placed by its host's Ray resource (``host<i>``).

A case is H receiving hosts x K rollouts each. Its parties live for the whole case (their
models are the bytes every row moves); each row is a session of its own on them, or a baseline
on the same hosts: Ray's object store (``ray-numpy``: the trainer puts the version's numpy
views, each rollout gets them; Ray pulls one copy per node and verifies nothing) and Ray Direct
Transport over gloo (``ray-rdt-gloo``: a trainer and rollouts of its own on the same hosts).
Rows take turns: every round runs each row once, the order rotated by one each round, so no
row always follows the same neighbour. A row's figures are its timed versions' seconds, from
the trainer's first call to the last rollout's load (the trainer's diff included: a delta
version is diffed in ``stage``), and what crossed each host's link meanwhile, read from the
links' own counters by the driver (``ASK links`` on stdout, one JSON line back on stdin).
Each row ends with the bit-exact check of every rollout against the trainer.
The last line is ``RESULT {...}``.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import ray

from weightsync.coordinator.client import Coordinator

from .actors import BenchRollout, BenchTrainer
from .hosts import SESSIONS
from .layouts import layout
from .rdt_rows import RdtRollout, RdtTrainer

TIMEOUT_S = 300.0


def ask(what: str) -> dict[str, Any]:
    print("ASK " + json.dumps({"ask": what}), flush=True)
    line = sys.stdin.readline()
    if not line:
        raise RuntimeError(f"the driver did not answer {what!r}")
    return json.loads(line)


def on(host: int) -> dict[str, Any]:
    return {"num_cpus": 0, "resources": {f"host{host}": 0.01}}


class Case:
    """The parties of one case: a trainer on host 0, ``per_host`` rollouts on each of hosts
    1..``hosts``; the RDT pair is made when its row first runs."""

    def __init__(self, plan: dict[str, Any], hosts: int, per_host: int):
        self.plan, self.hosts, self.per_host = plan, hosts, per_host
        self.manifest = layout(plan["model"])
        wire, update = self.manifest.to_wire(), plan["update"]
        self.trainer = ray.remote(BenchTrainer).options(**on(0)).remote(wire, "cpu", None, update=update)
        self.placed = [(h, k) for h in range(1, hosts + 1) for k in range(per_host)]
        self.rollouts = [ray.remote(BenchRollout).options(**on(h)).remote(wire, f"rollout-h{h}-{k}", i, "cpu")
                         for i, (h, k) in enumerate(self.placed)]
        self.rdt: tuple[Any, list[Any]] | None = None
        ray.get([a.pid.remote() for a in (self.trainer, *self.rollouts)], timeout=TIMEOUT_S)

    @property
    def label(self) -> str:
        return f"{self.hosts}x{self.per_host}"

    def rdt_pair(self) -> tuple[Any, list[Any]]:
        if self.rdt is None:
            from ray.experimental.collective import create_collective_group

            wire, update = self.manifest.to_wire(), self.plan["update"]
            remote = ray.remote(enable_tensor_transport=True)
            trainer = remote(RdtTrainer).options(**on(0)).remote(wire, "cpu", None, update=update)
            rollouts = [remote(RdtRollout).options(**on(h)).remote(wire, f"rdt-h{h}-{k}", i, "cpu")
                        for i, (h, k) in enumerate(self.placed)]
            ray.get([a.pid.remote() for a in (trainer, *rollouts)], timeout=TIMEOUT_S)
            create_collective_group([trainer, *rollouts], backend="gloo")
            self.rdt = (trainer, rollouts)
        return self.rdt

    def close(self) -> None:
        for a in (self.trainer, *self.rollouts, *((self.rdt[0], *self.rdt[1]) if self.rdt else ())):
            try:
                ray.kill(a)
            except Exception:
                pass


class Versions:
    """Version numbers for the whole run: every row's versions differ from the one before by
    one training step (the trainer's update model alternates two neighbours by parity)."""

    def __init__(self) -> None:
        self.v = 0

    def __call__(self) -> int:
        self.v += 1
        return self.v


def read_links() -> list[list[int]]:
    return ask("links")["links"]


def link_delta(before: list[list[int]], after: list[list[int]]) -> list[list[int]]:
    """Per host: [bytes sent, bytes received] between the two readings."""
    return [[a[0] - b[0], a[1] - b[1]] for a, b in zip(after, before)]


def _session_row(case: Case, row: str, nv: Versions) -> dict[str, Any]:
    plan = case.plan
    cfg = {**plan["config"], **SESSIONS[row]}
    coord = Coordinator.create(cfg, name=f"ws-bench-hosts-{os.getpid()}-{nv.v}", actor_options=on(0))
    try:
        ray.get([case.trainer.open.remote(coord, cfg, len(case.rollouts)),
                 *[r.open.remote(coord, cfg) for r in case.rollouts]], timeout=TIMEOUT_S)

        def version() -> dict[str, Any]:
            v = nv()
            applied = [r.apply.remote(v) for r in case.rollouts]
            step = ray.get(case.trainer.step.remote(v), timeout=TIMEOUT_S)
            ends = ray.get(applied, timeout=TIMEOUT_S)
            return {"seconds": max(e["end"] for e in ends) - step["t0"], "stage_s": step["stage_s"],
                    "changed": step["changed_fraction"], "wire": step["metrics"].get("wire_bytes")}

        for _ in range(plan["warmup"]):
            version()
        before = read_links()
        got = [version() for _ in range(plan["versions"])]
        moved = link_delta(before, read_links())
        transport = coord.status().transport
        closed = ray.get([case.trainer.close_session.remote(), *[r.close_session.remote() for r in case.rollouts]],
                         timeout=TIMEOUT_S)
    finally:
        coord.shutdown()
    want = ray.get(case.trainer.digest.remote(), timeout=TIMEOUT_S)
    verified = ray.get([r.digest.remote() for r in case.rollouts], timeout=TIMEOUT_S) == [want] * len(case.rollouts)
    return {"seconds": [g["seconds"] for g in got], "stage_s": [g["stage_s"] for g in got],
            "changed_fraction": [g["changed"] for g in got], "links": moved, "verified": verified,
            "transport": transport, "delta_state": closed[0].get("delta_state")}


def _ray_numpy_row(case: Case, nv: Versions) -> dict[str, Any]:
    seconds = []
    for i in range(case.plan["warmup"] + case.plan["versions"]):
        if i == case.plan["warmup"]:
            before = read_links()
        v = nv()
        put = ray.get(case.trainer.ray_put.remote("ray-numpy", v), timeout=TIMEOUT_S)
        ends = ray.get([r.ray_load.remote(put["ref"]) for r in case.rollouts], timeout=TIMEOUT_S)
        if i >= case.plan["warmup"]:
            seconds.append(max(e["end"] for e in ends) - put["t0"])
        del put
    moved = link_delta(before, read_links())
    want = ray.get(case.trainer.digest.remote(), timeout=TIMEOUT_S)
    verified = ray.get([r.digest.remote() for r in case.rollouts], timeout=TIMEOUT_S) == [want] * len(case.rollouts)
    return {"seconds": seconds, "links": moved, "verified": verified}


def _rdt_row(case: Case, nv: Versions) -> dict[str, Any]:
    trainer, rollouts = case.rdt_pair()
    seconds = []
    for i in range(case.plan["warmup"] + case.plan["versions"]):
        if i == case.plan["warmup"]:
            before = read_links()
        ray.get(trainer.bump.remote(nv()), timeout=TIMEOUT_S)
        t0 = time.monotonic()
        ref = trainer.tensors_out.options(tensor_transport="gloo").remote()
        ends = ray.get([r.load_rdt.remote(ref) for r in rollouts], timeout=TIMEOUT_S)
        del ref
        if i >= case.plan["warmup"]:
            seconds.append(max(e["end"] for e in ends) - t0)
    moved = link_delta(before, read_links())
    want = ray.get(trainer.digest.remote(), timeout=TIMEOUT_S)
    verified = ray.get([r.digest.remote() for r in rollouts], timeout=TIMEOUT_S) == [want] * len(rollouts)
    return {"seconds": seconds, "links": moved, "verified": verified}


def run_row(case: Case, row: str, nv: Versions) -> dict[str, Any]:
    t0 = time.monotonic()
    try:
        if row in SESSIONS:
            out = _session_row(case, row, nv)
        elif row == "ray-numpy":
            out = _ray_numpy_row(case, nv)
        else:
            out = _rdt_row(case, nv)
    except Exception as exc:  # a row that fails is reported, the others still run
        out = {"error": f"{type(exc).__name__}: {exc}"[-2000:]}
    out["row_s"] = time.monotonic() - t0
    return out


def run(plan: dict[str, Any]) -> dict[str, Any]:
    nv = Versions()
    cases: list[dict[str, Any]] = []
    for hosts, per_host in plan["cases"]:
        case = Case(plan, hosts, per_host)
        try:
            update = ray.get(case.trainer.update_info.remote(), timeout=TIMEOUT_S)
            rows: dict[str, list[dict[str, Any]]] = {r: [] for r in plan["rows"]}
            for rnd in range(plan["rounds"]):
                order = plan["rows"][rnd % len(plan["rows"]):] + plan["rows"][:rnd % len(plan["rows"])]
                for row in order:
                    print(f"PROGRESS case {case.label} round {rnd + 1} {row}", flush=True)
                    rows[row].append(run_row(case, row, nv))
            cases.append({"case": case.label, "receiving_hosts": hosts, "per_host": per_host, "rows": rows,
                          "update": update})
        finally:
            case.close()
    return {"payload": layout(plan["model"]).total_bytes, "cases": cases}


def serve(run: Callable[[dict[str, Any]], dict[str, Any]]) -> int:
    """A job inside host 0: ``run`` the driver's plan on the cluster's Ray, print ``RESULT {...}``
    (an error as one too)."""
    plan = json.loads(os.environ["WS_BENCH_PLAN"])
    ray.init(address=os.environ["WS_RAY_ADDRESS"], logging_level="ERROR", log_to_driver=False)
    try:
        out = run(plan)
    except Exception as exc:
        out = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-4000:]}
    print("RESULT " + json.dumps(out), flush=True)
    ray.shutdown()
    return 0


def main() -> int:
    return serve(run)


if __name__ == "__main__":
    sys.exit(main())
