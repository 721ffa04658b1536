"""Across nodes: a three-node Ray cluster on this machine (tests/multinode_job.py, run in a
process of its own so the session's Ray is never touched). Trainer on node A, rollouts on
nodes B and C; transport auto. One run of the job serves both tests (~35 s on 2 cores)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("multinode") / "job.json"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    # a Ray temp dir of its own: the job's sessions, sockets and its "current cluster" record
    # stay apart from the test session's Ray (short path: Unix socket names are limited)
    env["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="wsmn-", dir="/tmp" if os.path.isdir("/tmp") else None)
    try:
        proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "multinode_job.py"), str(out)],
                              env=env, cwd=ROOT, capture_output=True, text=True, timeout=400)
    finally:
        shutil.rmtree(env["RAY_TMPDIR"], ignore_errors=True)
    seen = json.loads(out.read_text()) if out.exists() else {}
    assert proc.returncode == 0 and "error" not in seen, (seen.get("error"), proc.stderr[-3000:])
    assert seen["left"] == [], f"processes left after the cluster shut down: {seen['left']}"
    return seen


def test_auto_relays_to_other_nodes_from_the_senders_node_address(job):
    nodes, parties = job["node_ids"], job["parties"]
    where = {name: next(n for n, nid in nodes.items() if nid == p["node_id"]) for name, p in parties.items()}
    assert where == {"trainer-0": "A", "rollout-0": "B", "rollout-1": "C"}
    assert job["transport"] == "relay"
    assert job["reason"].startswith("auto: 2 receiver(s) (rollout-0, rollout-1) on other nodes (")
    assert "relay: one copy per receiving node, passed on from node to node" in job["reason"]
    for name in ("rollout-0", "rollout-1"):
        assert f"{parties[name]['host']} (node {parties[name]['node_id'][:8]})" in job["reason"]
    # the rendezvous store listens on the sender's node address (rendezvous_host: auto)
    assert job["rendezvous"] == parties["trainer-0"]["host"]
    if job["addresses"][0] is not None:  # distinct loopback addresses per node (Linux)
        assert [parties[n]["host"] for n in ("trainer-0", "rollout-0", "rollout-1")] == job["addresses"]
    for v in (1, 2):
        assert job[f"v{v}"]["state"] == "COMMITTED"
        assert job[f"v{v}"]["serves"] == {n: {"version": v, "bit_exact": True} for n in ("rollout-0", "rollout-1")}


@pytest.mark.scenario("fault", "node lost mid-version (its raylet removed; three-node Ray cluster on one machine)",
                      transport="relay", promise=(
    "both rollouts held after bucket 0 of v3, node C removed: the party on it is named silent on its node's "
    "address, the survivor fails with 'lost receiver', v3 ABORTED within the deadline; the survivor serves v2 "
    "bit-exact; v4 commits on the survivor alone"))
def test_node_lost_mid_version_is_named_and_the_next_version_commits_without_it(job):
    v3, host_c = job["v3"], job["parties"]["rollout-1"]["host"]
    # node C removed while both rollouts stood after bucket 0 of v3: the party on it is named
    assert v3["sync"]["committed"] == []
    assert set(v3["sync"]["failed"]) == {"rollout-1", "rollout-0"}
    assert f"on {host_c}) silent" in v3["sync"]["failed"]["rollout-1"]
    assert "lost receiver 'rollout-1'" in v3["sync"]["failed"]["rollout-0"]
    assert "lost receiver 'rollout-1'" in v3["rollout-0"]["error"]
    assert v3["failed_after_s"] < 30.0, "surfaced within sync_timeout_s"
    assert v3["state"] == "ABORTED"
    # the survivor on node B had only part of v3's first tensor: it serves v2, whole
    assert v3["serves"] == {"rollout-0": {"version": 2, "bit_exact": True}}
    assert job["v4"] == {"applied": {"rollout-0": 4}, "state": "COMMITTED",
                         "serves": {"rollout-0": {"version": 4, "bit_exact": True}}}
