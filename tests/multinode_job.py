"""A three-node Ray cluster on this machine, in a process of its own (never the test session's
Ray): run by tests/test_multinode.py as ``python tests/multinode_job.py OUT.json``.

Node A (head) holds the coordinator and the trainer, nodes B and C one rollout worker each,
placed by custom resources. Each node is a raylet of its own with a Ray node id of its own;
its address is 127.0.0.2 / .3 / .4 where the loopback takes them (Linux), else all nodes
share Ray's default address (the report says which): placement goes by node id either way.

What it does, writing what it saw to OUT.json for the test to assert on:
  v1, v2   transport auto, both versions committed and served bit-exact
  v3       both rollouts stop after loading bucket 0 (the fault point), node C is removed
           (its raylet and workers killed), the version fails naming the party on node C
  v4       goes on with the survivor on node B and commits
Then the cluster is shut down and every process this script started must be gone.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from typing import Any

import psutil
import ray
from ray.cluster_utils import Cluster
from support.parties import TrainerWorker, check_serves, rollout_actor, trainer_actor, wait_until

from weightsync import Coordinator, SyncFailed
from weightsync.manifest import Manifest, TensorSpec

DEADLINE_S = 30.0
# test_broadcast.py's WIDE layout: the first tensor spans 6 buckets and the version is far larger
# than two buckets plus the socket buffers, so a member stopped at bucket 0 decides the outcome
LAYOUT = Manifest((TensorSpec("embed", "bfloat16", (2048, 6144)),
                   *(TensorSpec(f"layers.{i}.w", "bfloat16", (1024, 2048)) for i in range(8))))
CFG = {"transport": "auto", "bucket_mb": 4.0, "sync_timeout_s": DEADLINE_S, "device": "cpu",
       "heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 3.0, "connect_timeout_s": 60.0}
NODE = {"num_cpus": 2, "object_store_memory": 80 * 2**20}


def addresses() -> list[str | None]:
    """127.0.0.2-4 where this loopback answers on them, else Ray's default for every node.
    127.0.0.1 is not used: Ray rewrites it to the machine's address when a driver connects.
    MULTINODE_ONE_ADDRESS=1 forces the fallback (to check it where the loopback has them)."""
    try:
        if os.environ.get("MULTINODE_ONE_ADDRESS") == "1":
            raise OSError("one address requested")
        for last in (2, 3, 4):
            with socket.socket() as s:
                s.bind((f"127.0.0.{last}", 0))
    except OSError:
        return [None, None, None]
    return ["127.0.0.2", "127.0.0.3", "127.0.0.4"]


class Trainer(TrainerWorker):
    def rendezvous(self) -> str:
        """The address this sender's rendezvous store listens on (rendezvous_host: auto)."""
        return self.sender.transport.session.host


def serves(worker: Any) -> dict[str, Any]:
    """The version a rollout serves, and whether its weights are exactly that version's."""
    served, bad = check_serves(worker, LAYOUT)
    return {"version": served, "bit_exact": None if served is None else not bad}


def run(cluster: Cluster, nodes: dict[str, Any], out: dict[str, Any]) -> None:
    coord = Coordinator.create(CFG, name="ws-multinode", actor_options={"resources": {"node_a": 0.01}})
    def on(node: str) -> dict[str, Any]:  # threaded: reached() / release() beside a held apply()
        return {"max_concurrency": 4, "resources": {node: 1}}

    rollouts = {name: rollout_actor(coord, LAYOUT, name, rank, CFG, on(node))
                for rank, (name, node) in enumerate((("rollout-0", "node_b"), ("rollout-1", "node_c")))}
    trainer = trainer_actor(coord, LAYOUT, CFG, 2, on("node_a"), cls=Trainer)
    ray.get([r.version.remote() for r in rollouts.values()], timeout=120)
    out["node_ids"] = {name: node.node_id for name, node in nodes.items()}

    def step(v: int, names: tuple[str, ...]) -> dict[str, Any]:
        applied = {n: rollouts[n].apply.remote(v) for n in names}
        ray.get(trainer.step.remote(v), timeout=120)
        return {n: ray.get(ref, timeout=60) for n, ref in applied.items()}

    both = ("rollout-0", "rollout-1")
    for v in (1, 2):
        out[f"v{v}"] = {"applied": step(v, both), "state": coord.metrics(v).state,
                        "serves": {n: serves(rollouts[n]) for n in both}}
    status = coord.status()
    out["parties"] = {p.name: {"host": p.host, "node_id": p.node_id} for p in status.parties}
    out["transport"], out["reason"] = status.transport, status.transport_reason
    out["rendezvous"] = ray.get(trainer.rendezvous.remote())

    # v3: held at the fault point on both nodes, then node C goes
    ray.get([r.hold_at.remote(3, 0) for r in rollouts.values()])
    ray.get(trainer.stage.remote(3))
    applied = {n: r.apply.remote(3) for n, r in rollouts.items()}
    sync = trainer.sync.remote(3)
    assert all(ray.get([r.reached.remote(DEADLINE_S) for r in rollouts.values()]))
    t0 = time.monotonic()
    cluster.remove_node(nodes["C"], allow_graceful=False)
    wait_until("rollout-1 is failed in v3", lambda: "rollout-1" in coord.metrics(3).failed)
    ray.get(rollouts["rollout-0"].release.remote())
    v3: dict[str, Any] = {}
    try:
        ray.get(sync, timeout=DEADLINE_S + 30)
        v3["sync"] = "committed"
    except SyncFailed as err:
        v3["sync"] = {"failed": err.failed, "committed": err.committed}
    v3["failed_after_s"] = time.monotonic() - t0
    try:
        v3["rollout-0"] = {"applied": ray.get(applied["rollout-0"], timeout=DEADLINE_S + 30)}
    except ray.exceptions.RayTaskError as exc:
        v3["rollout-0"] = {"error": str(exc)[-1500:]}
    v3["state"] = coord.metrics(3).state
    v3["serves"] = {"rollout-0": serves(rollouts["rollout-0"])}
    out["v3"] = v3
    out["v4"] = {"applied": step(4, ("rollout-0",)), "state": coord.metrics(4).state,
                 "serves": {"rollout-0": serves(rollouts["rollout-0"])}}
    for actor in (trainer, rollouts["rollout-0"]):
        ray.get(actor.close.remote(), timeout=10)
        ray.kill(actor)
    coord.shutdown()


def main(path: str) -> None:
    ips = addresses()
    out: dict[str, Any] = {"addresses": ips}
    t0 = time.monotonic()
    cluster = Cluster(initialize_head=True, head_node_args={
        **NODE, "resources": {"node_a": 4}, "include_dashboard": False, "node_ip_address": ips[0]})
    try:
        nodes = {"A": cluster.head_node}
        for name, ip in (("B", ips[1]), ("C", ips[2])):
            nodes[name] = cluster.add_node(**NODE, resources={f"node_{name.lower()}": 4}, node_ip_address=ip)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, _node_ip_address=ips[0], log_to_driver=False, logging_level="ERROR")
        out["start_s"] = time.monotonic() - t0
        run(cluster, nodes, out)
    except BaseException as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"[-3000:]
        raise
    finally:
        ray.shutdown()
        cluster.shutdown()

        def running() -> list:
            return [p for p in psutil.Process().children(recursive=True)
                    if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]

        wait_until("every process of the cluster has exited", lambda: not running(), timeout=20, interval=0.5,
                   strict=False)
        out["left"] = [(p.pid, p.name()) for p in running()]
        out["total_s"] = time.monotonic() - t0
        with open(path, "w") as f:
            json.dump(out, f, indent=1, default=str)


if __name__ == "__main__":
    os.environ.pop("RAY_ADDRESS", None)
    main(sys.argv[1])
