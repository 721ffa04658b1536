"""Hosts that share nothing, on this machine (benchmarks/weightsync_bench/hostnet.py): network namespaces on a bridge,
each host with its own address, /dev/shm and /tmp, links limited with tbf both ways. Needs root;
elsewhere every test here skips and says why (tests/test_multinode.py, three raylets sharing
one host, stays the fallback). Marked ``hosts``: the hosts tier runs them
(``bash scripts/tiers/hosts.sh``), the default run leaves them out.

First the cluster itself (namespaces only: isolation, the link's rate and counters, cut and
restore, teardown), then a Ray cluster of 3 hosts whose job (tests/hostjob.py, run inside
host 0) puts the host-level faults where its parties stop: trainer and coordinator on host 0,
one rollout each on hosts 1 and 2, transport auto (relay: host 0 sends to host 1, which passes each
bucket on to host 2). The job asks, the test
acts on the links (cut, restore, rate, kill) and answers; each fault's specified outcome is its
test's ``scenario`` promise, asserted exactly.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
from weightsync_bench.hostnet import Cluster, available

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON = sys.executable
LINK_GBIT = 2.0  # the job's links
HEARTBEAT_TIMEOUT_S = 3.0  # tests/hostjob.py's CFG
SYNC_TIMEOUT_S = 30.0
# Ray's own health checks must outlast a cut host: 100 missed checks (5 min) before the GCS
# declares a node dead, 5 min before a raylet cut off from the GCS gives up
RAY_PATIENCE = {"RAY_health_check_failure_threshold": "100", "RAY_gcs_rpc_server_reconnect_timeout_s": "300"}
JOB_ENV = {"PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]), **RAY_PATIENCE}

pytestmark = [pytest.mark.hosts, pytest.mark.timeout(600)]  # the job's fixture: about 2 min on 2 cores


@pytest.fixture(scope="session")
def can_build():
    ok, why = available()
    if not ok:
        pytest.skip(f"isolated hosts unavailable: {why}")


def _ours() -> set[str]:
    """Every namespace and link on this machine whose name a Cluster would give."""
    spaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    return {n for n in spaces if n.startswith("ws")} | {n for n in os.listdir("/sys/class/net") if n.startswith("ws")}


@pytest.fixture(scope="module")
def net(can_build):
    """3 hosts, namespaces only, links at 1 Gbit/s."""
    cluster = Cluster(hosts=3, link_gbit=1.0, ray=False)
    try:
        yield cluster
    finally:
        cluster.close()


def host_python(cluster: Cluster, host: int, code: str, *args: str, timeout: float = 60.0) -> str:
    """Run ``code`` with the venv's python inside ``host``; its stdout (fails on an error)."""
    proc = cluster.run(host, [PYTHON, "-c", code, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert proc.returncode == 0, err[-2000:]
    return out


# -- the cluster itself ----------------------------------------------------------------------

WHERE = """
import os, socket, fcntl, struct
name = "/dev/shm/wsh-probe-%s" % os.environ["WS_HOST"]
open(name, "w").close()
open("/tmp/wsh-probe-%s" % os.environ["WS_HOST"], "w").close()
with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
    addr = socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", b"eth0"))[20:24])
print(addr, " ".join(sorted(os.listdir("/dev/shm"))), "|", " ".join(sorted(os.listdir("/tmp"))))
"""


def test_each_host_has_its_own_dev_shm_tmp_and_address(net):
    seen = {}
    for host in (1, 2):
        addr, rest = host_python(net, host, WHERE).split(" ", 1)
        shm, tmp = (part.split() for part in rest.split("|"))
        seen[host] = (addr, shm, tmp)
    # each host sees only what it made itself, and neither is in the machine's own /dev/shm or /tmp
    assert seen[1] == (net.address(1), ["wsh-probe-1"], ["r", "wsh-probe-1"])
    assert seen[2] == (net.address(2), ["wsh-probe-2"], ["r", "wsh-probe-2"])
    assert not any(os.path.exists(f"{d}/wsh-probe-{h}") for d in ("/dev/shm", "/tmp") for h in (1, 2))
    assert net.read(1, "/dev/shm/wsh-probe-1") == b"" and net.read(2, "/dev/shm/wsh-probe-1") is None
    assert net.addresses == [str(net.network.network_address + i) for i in (1, 2, 3)]


SERVE = """
import socket, sys, time
srv = socket.create_server((sys.argv[1], 0))
print(srv.getsockname()[1], flush=True)
conn, _ = srv.accept()
want, got, t0 = int(sys.argv[2]), 0, None
while got < want:
    chunk = conn.recv(1 << 20)
    if not chunk:
        break
    t0 = t0 or time.perf_counter()
    got += len(chunk)
print(got, time.perf_counter() - t0, flush=True)
"""
SEND = """
import socket, sys
payload = b"\\x5a" * int(sys.argv[3])
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30) as s:
    s.sendall(payload)
"""


def send_between(cluster: Cluster, src: int, dst: int, nbytes: int) -> tuple[int, float]:
    """``nbytes`` from host ``src`` to host ``dst`` over TCP: (bytes received, seconds from the
    first byte received to the last)."""
    server = cluster.run(dst, [PYTHON, "-c", SERVE, cluster.address(dst), str(nbytes)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    port = server.stdout.readline().strip()
    assert port.isdigit(), server.stderr.read()[-2000:]
    host_python(cluster, src, SEND, cluster.address(dst), port, str(nbytes))
    out, err = server.communicate(timeout=60)
    got, seconds = out.split()
    return int(got), float(seconds)


def test_a_payload_crosses_a_link_at_its_rate_and_its_counters_show_it(net, record_property):
    nbytes, gbit = 64 * 2**20, net.link_gbit[2]
    before = [net.link_bytes(h) for h in (1, 2)]
    got, seconds = send_between(net, 1, 2, nbytes)
    after = [net.link_bytes(h) for h in (1, 2)]
    link_s = nbytes * 8 / (gbit * 1e9)
    ratio = seconds / link_s
    record_property("link_time_ratio", round(ratio, 3))
    print(f"\n64 MiB host 1 -> host 2 at {gbit} Gbit/s: {seconds:.3f} s, {ratio:.2f}x the link time ({link_s:.3f} s)")
    assert got == nbytes
    assert 0.7 <= ratio <= 1.5, f"{seconds:.3f} s for a link time of {link_s:.3f} s"
    sent = after[0][0] - before[0][0]  # host 1's tx
    received = after[1][1] - before[1][1]  # host 2's rx
    # the payload and its TCP/IP headers (a few %), nothing else of size
    assert nbytes <= sent <= nbytes * 1.08 and nbytes <= received <= nbytes * 1.08, (sent, received)


CONNECT = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])).close()
    print("connected")
except OSError as exc:
    print(type(exc).__name__)
"""


def test_a_cut_link_refuses_connections_and_a_restored_one_carries_them(net):
    server = net.run(2, [PYTHON, "-c", "import socket,sys\ns=socket.create_server((sys.argv[1],0))\n"
                         "print(s.getsockname()[1],flush=True)\nwhile True: s.accept()[0].close()",
                         net.address(2)], stdout=subprocess.PIPE, text=True)
    port = server.stdout.readline().strip()
    assert host_python(net, 1, CONNECT, net.address(2), port, "5").strip() == "connected"
    net.cut(2)
    try:
        assert host_python(net, 1, CONNECT, net.address(2), port, "2").strip() in ("TimeoutError", "OSError")
        assert net.pids(2), "the cut host's processes live on"
    finally:
        net.restore(2)
    assert host_python(net, 1, CONNECT, net.address(2), port, "5").strip() == "connected"
    server.kill()
    server.wait()


def test_close_leaves_nothing_also_after_a_construction_that_failed_half_way(can_build):
    before = _ours()
    with pytest.raises(RuntimeError, match="did not come up"):  # host 0's tmpfs refused, its link made
        with Cluster(hosts=2, link_gbit=1.0, ray=False, shm_mb=-1):
            pass
    assert _ours() == before
    cluster = Cluster(hosts=2, link_gbit=1.0, ray=False)
    assert _ours() > before
    cluster.close()
    cluster.close()  # idempotent
    assert cluster.leftovers() == [] and _ours() == before


# -- a Ray cluster on 3 hosts: placement and the host-level faults ----------------------------

@pytest.fixture(scope="module")
def ray_hosts(can_build):
    cluster = Cluster(hosts=3, link_gbit=LINK_GBIT, env=JOB_ENV)
    try:
        yield cluster
    finally:
        cluster.close()


PLACE = """
import json, os, ray
ray.init(address=os.environ["WS_RAY_ADDRESS"], logging_level="ERROR", log_to_driver=False)

@ray.remote(num_cpus=0, resources={"host2": 1})
def where():
    open("/dev/shm/wsh-task", "w").close()
    return {"node_id": ray.get_runtime_context().get_node_id(), "address": ray.util.get_node_ip_address(),
            "host": os.environ["WS_HOST"]}

nodes = {n["NodeManagerAddress"]: n["NodeID"] for n in ray.nodes() if n["Alive"]}
print(json.dumps({"nodes": nodes, "task": ray.get(where.remote(), timeout=60)}))
"""


def test_a_task_placed_on_host_2_runs_there(ray_hosts):
    seen = json.loads(host_python(ray_hosts, 0, PLACE, timeout=120).strip().splitlines()[-1])
    assert set(seen["nodes"]) == set(ray_hosts.addresses)
    assert seen["task"] == {"node_id": seen["nodes"][ray_hosts.address(2)], "address": ray_hosts.address(2),
                            "host": "2"}
    # its file is in host 2's /dev/shm only
    assert ray_hosts.read(2, "/dev/shm/wsh-task") == b""
    assert ray_hosts.read(1, "/dev/shm/wsh-task") is None and not os.path.exists("/dev/shm/wsh-task")


class Driver:
    """tests/hostjob.py inside host 0; answers its events by acting on the cluster's links."""

    def __init__(self, cluster: Cluster, phases: list[str], env: dict[str, str] | None = None):
        self.cluster, self.log = cluster, []
        self.proc = cluster.run(0, [PYTHON, "-u", os.path.join(ROOT, "tests", "hostjob.py")],
                                env={"WS_JOB_PHASES": " ".join(phases), **(env or {})}, cwd=ROOT,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def files(self, files: dict[str, str]) -> dict[str, Any]:
        found = {}
        for host, path in files.items():
            data = self.cluster.read(int(host), path)
            if data:
                found[host] = json.loads(data)
        return found

    def await_files(self, files: dict[str, str], timeout: float) -> dict[str, Any]:
        end = time.monotonic() + timeout
        while len(found := self.files(files)) < len(files) and time.monotonic() < end:
            time.sleep(0.1)
        return found

    def answer(self, ev: dict[str, Any]) -> dict[str, Any]:
        c, host, what = self.cluster, ev.get("host"), ev["event"]
        if what == "links":
            return {"links": [c.link_bytes(h) for h in range(c.hosts)]}
        if what == "rate":
            c.set_rate(host, LINK_GBIT if ev["gbit"] is None else ev["gbit"])
            return {}
        if what == "cut":
            c.cut(host)
            return {"at": time.time()}
        if what == "restore":  # what the rollouts had written while cut off, then the link back
            found = self.files(ev.get("files", {}))
            c.restore(host)
            return {"at": time.time(), "files": found}
        if what == "await-files":
            return {"files": self.await_files(ev["files"], ev["timeout"])}
        if what == "cut-until":
            c.cut(host)
            at = time.time()
            found = self.await_files(ev["files"], ev["timeout"])
            c.restore(host)
            return {"at": at, "restored_at": time.time(), "files": found}
        if what == "kill":
            pids = c.kill(host)
            return {"at": time.time(), "pids": pids}
        if what == "hostile":
            self.hostile = c.run(host, [PYTHON, "-c", HOSTILE, ev["address"], str(ev["port"])],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            ready = self.hostile.stdout.readline().strip()
            assert ready.startswith("READY"), ready
            return {"ready": ready}
        if what == "hostile-end":
            self.hostile.stdin.close()
            self.hostile.wait(60)
            return {}
        raise AssertionError(f"the job asked for {what!r}")

    def run(self, timeout: float) -> dict[str, Any]:
        end = time.monotonic() + timeout
        try:
            while True:
                try:
                    line = self.lines.get(timeout=max(0.1, end - time.monotonic()))
                except queue.Empty:
                    raise AssertionError(f"the job did not finish within {timeout:.0f} s: {self.tail()}") from None
                if line is None:
                    raise AssertionError(f"the job ended without a result: {self.tail()}")
                if line.startswith("EVENT "):
                    reply = self.answer(json.loads(line[6:]))
                    self.proc.stdin.write(json.dumps(reply) + "\n")
                    self.proc.stdin.flush()
                elif line.startswith("RESULT "):
                    out = json.loads(line[7:])
                    assert "error" not in out, f"{out['error']}\n{self.tail()}"
                    return out
                else:
                    self.log.append(line)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait(30)

    def tail(self) -> str:
        return "".join(self.log[-60:])[-6000:]


# clients without the session token: 200 that connect and idle, 24 that announce a 64 MiB frame and
# stream 63 MiB of it; they stay until their stdin closes
HOSTILE = """
import socket, sys, threading
address, port = sys.argv[1], int(sys.argv[2])
idle = [socket.create_connection((address, port), timeout=10) for _ in range(200)]
chunk = b"\\0" * (1 << 20)

def stream():
    try:
        s = socket.create_connection((address, port), timeout=10)
        s.sendall((64 << 20).to_bytes(4, "big"))
        for _ in range(63):
            s.sendall(chunk)
    except OSError:
        pass

threads = [threading.Thread(target=stream, daemon=True) for _ in range(24)]
for t in threads:
    t.start()
print("READY", len(idle), flush=True)
sys.stdin.read()
"""


@pytest.fixture(scope="module")
def job(ray_hosts):
    return Driver(ray_hosts, ["placement", "slow_link", "partition", "coordinator_cut", "hostile",
                              "lost_host"]).run(400)


def link_s(nbytes: int, gbit: float) -> float:
    return nbytes * 8 / (gbit * 1e9)


def test_auto_relays_from_host_0_through_host_1_to_host_2_one_payload_per_link(job, ray_hosts, record_property):
    p, where = job["placement"], job["placement"]["where"]
    assert {n: p["parties"][n]["host"] for n in ("trainer-0", "rollout-0", "rollout-1")} == \
        dict(zip(("trainer-0", "rollout-0", "rollout-1"), ray_hosts.addresses))
    assert {n: p["parties"][n]["node_id"] for n in ("rollout-0", "rollout-1")} == \
        {"rollout-0": p["nodes"]["host1"], "rollout-1": p["nodes"]["host2"]}
    assert {n: (w["host"], w["address"]) for n, w in where.items()} == \
        {"rollout-0": ("1", ray_hosts.address(1)), "rollout-1": ("2", ray_hosts.address(2))}
    assert p["transport"] == "relay"
    assert p["reason"].startswith("auto: 2 receiver(s) (rollout-0, rollout-1) on other nodes (")
    assert "relay: one copy per receiving node, passed on from node to node" in p["reason"]
    for v in ("v1", "v2"):
        assert p[v]["state"] == "COMMITTED" and p[v]["failed"] == {}
        assert p[v]["serves"] == {n: {"version": int(v[1]), "bit_exact": True} for n in ("rollout-0", "rollout-1")}
    # one payload leaves host 0; host 1 takes it in and passes it on; host 2 takes it in
    payload, links = p["payload"], p["v2"]["links"]
    tx0, rx1, tx1, rx2 = (links[0][0] / payload, links[1][1] / payload, links[1][0] / payload,
                          links[2][1] / payload)
    ratio = p["v2"]["sync"]["barrier_s"] / link_s(payload, LINK_GBIT)
    record_property("v2_payloads_host0", round(tx0, 3))
    record_property("v2_barrier_over_link_time", round(ratio, 3))
    print(f"\nv2: {p['v2']['sync']['barrier_s']:.3f} s at the barrier, {ratio:.2f}x the link time of 1 payload; "
          f"payloads out of host 0: {tx0:.3f}, into / out of host 1: {rx1:.3f} / {tx1:.3f}, into host 2: {rx2:.3f}")
    for n in (tx0, rx1, tx1, rx2):
        assert 1.0 <= n <= 1.05, (tx0, rx1, tx1, rx2)


@pytest.mark.scenario("fault", "slow link: host 2's link at 50 Mbit/s under a version that fits the deadline "
                      "(isolated hosts)", transport="relay", promise=(
    "the 32 MiB version takes longer than heartbeat_timeout_s on host 2's link and commits on both hosts: no party "
    "is reported dead and none failed at any moment while the bytes move; both serve it bit-exact"))
def test_a_slow_link_declares_no_one_dead_while_bytes_move(job, record_property):
    v = job["slow_link"]["v"]
    assert v["state"] == "COMMITTED" and v["failed"] == {} and sorted(v["committed"]) == ["rollout-0", "rollout-1"]
    assert v["seen_dead"] == []
    assert v["serves"] == {n: {"version": v["version"], "bit_exact": True} for n in ("rollout-0", "rollout-1")}
    ratio = v["sync"]["barrier_s"] / link_s(job["placement"]["payload"], 0.05)
    record_property("slow_barrier_over_link_time", round(ratio, 3))
    print(f"\n50 Mbit/s: {v['sync']['barrier_s']:.2f} s at the barrier, {ratio:.2f}x the link time of one payload")
    # it did outlast the heartbeat deadline, so a heartbeat starved behind the payload would show
    assert v["sync"]["barrier_s"] > HEARTBEAT_TIMEOUT_S


@pytest.mark.scenario("fault", "partition: a receiving host's link cut mid-version, its processes alive "
                      "(isolated hosts)", transport="relay", promise=(
    "both rollouts held inside load_weights at call 1 of v, host 2's link cut: the coordinator aborts v within "
    "heartbeat_timeout_s + 2 s naming rollout-1 silent on host 2's address, rollout-0 failed because the group "
    "lost rollout-1; the trainer's SyncFailed names both, committed none; rollout-0 raises with that reason and "
    "serves v - 1 bit-exact, replayed from its host's copy (it had loaded part of v); link restored and rollout-1 "
    "released: it raises the same and serves v - 1 bit-exact too; the next version commits on both hosts, bit-exact"))
def test_a_partitioned_host_is_named_within_the_deadline_and_rejoins(job, ray_hosts):
    got, nxt = job["partition"]["v"], job["partition"]["next"]
    host2 = ray_hosts.address(2)
    assert got["state"] == "ABORTED" and got["committed"] == []
    assert got["aborted_after_s"] <= HEARTBEAT_TIMEOUT_S + 2.0, got["aborted_after_s"]
    assert set(got["failed"]) == {"rollout-0", "rollout-1"}
    assert f"on {host2}) silent" in got["failed"]["rollout-1"]
    assert "lost receiver 'rollout-1'" in got["failed"]["rollout-0"]
    # the trainer's SyncFailed: the coordinator's reasons, or a receiver's own report where it came first
    assert set(got["sync"]["failed"]) == {"rollout-0", "rollout-1"} and got["sync"]["committed"] == []
    assert f"on {host2}) silent" in got["sync"]["failed"]["rollout-1"]
    assert "lost receiver 'rollout-1'" in got["sync"]["failed"]["rollout-0"]
    for name in ("rollout-0", "rollout-1"):
        assert "was aborted" in got[name]["error"] and "lost receiver 'rollout-1'" in got[name]["error"]
    # released once v was aborted, rollout-0 fails at once: nothing it holds waits on the cut link
    assert got["rollout-0"]["at"] - got["cut_at"] <= HEARTBEAT_TIMEOUT_S + 4.0, got["rollout-0"]["at"] - got["cut_at"]
    assert got["serves"] == {n: {"version": got["version"] - 1, "bit_exact": True} for n in ("rollout-0", "rollout-1")}
    assert nxt["state"] == "COMMITTED" and nxt["applied"] == {"rollout-0": got["version"] + 1,
                                                              "rollout-1": got["version"] + 1}
    assert nxt["serves"] == {n: {"version": got["version"] + 1, "bit_exact": True} for n in ("rollout-0", "rollout-1")}


@pytest.mark.scenario("fault", "the coordinator's host cut off from the receivers mid-version, restored once "
                      "it aborted the version (isolated hosts)", transport="relay", promise=(
    "trainer held before tensor 3 of v, both rollouts past 2 load calls, host 0's link cut: the coordinator "
    "aborts v within heartbeat_timeout_s + 2 s naming both rollouts silent on their hosts' addresses; meanwhile "
    "neither rollout has failed (each waits on a control call to the coordinator); link restored: the trainer's "
    "SyncFailed names both, and each rollout raises VersionError with the coordinator's reason and serves v - 1 "
    "bit-exact, replayed from its host's copy (it had loaded part of v); the next version commits on both, bit-exact"))
def test_the_coordinators_host_cut_off_aborts_and_the_next_version_commits(job, ray_hosts):
    got, nxt = job["coordinator_cut"]["v"], job["coordinator_cut"]["next"]
    assert got["state"] == "ABORTED" and got["committed"] == []
    assert got["aborted_after_s"] <= HEARTBEAT_TIMEOUT_S + 2.0, got["aborted_after_s"]
    assert set(got["failed"]) == {"rollout-0", "rollout-1"}
    for name, host in (("rollout-0", 1), ("rollout-1", 2)):
        assert f"on {ray_hosts.address(host)}) silent" in got["failed"][name]
    assert got["outcomes_while_cut"] == {}, "a rollout failed while it could not reach the coordinator"
    assert got["sync"]["failed"] == got["failed"] and got["sync"]["committed"] == []
    for host, name in (("1", "rollout-0"), ("2", "rollout-1")):
        error = got["outcomes"][host]["error"]
        assert error.startswith(f"Aborted: version {got['version']} was aborted: "), error
        assert f"'{name}'" in error and "silent" in error
    assert got["serves"] == {n: {"version": got["version"] - 1, "bit_exact": True} for n in ("rollout-0", "rollout-1")}
    assert nxt["state"] == "COMMITTED"
    assert nxt["serves"] == {n: {"version": got["version"] + 1, "bit_exact": True} for n in ("rollout-0", "rollout-1")}


@pytest.mark.scenario("fault", "lost host: every process on a receiving host killed mid-version "
                      "(isolated hosts)", transport="relay", promise=(
    "both rollouts held inside load_weights at call 1 of v, every process of host 2 SIGKILLed (raylet, workers): "
    "the coordinator aborts v within heartbeat_timeout_s + 2 s naming rollout-1 silent on host 2's address; "
    "rollout-0 fails because the group lost rollout-1 and serves v - 1 bit-exact, replayed from its host's copy; the "
    "next "
    "version commits on host 1 alone, bit-exact"))
def test_a_lost_host_is_named_within_the_deadline_and_the_next_version_goes_on_without_it(job, ray_hosts):
    got, nxt = job["lost_host"]["v"], job["lost_host"]["next"]
    assert got["state"] == "ABORTED" and got["committed"] == []
    assert got["aborted_after_s"] <= HEARTBEAT_TIMEOUT_S + 2.0, got["aborted_after_s"]
    assert set(got["failed"]) == {"rollout-0", "rollout-1"}
    assert f"on {ray_hosts.address(2)}) silent" in got["failed"]["rollout-1"]
    assert "lost receiver 'rollout-1'" in got["failed"]["rollout-0"]
    assert set(got["sync"]["failed"]) == {"rollout-0", "rollout-1"} and got["sync"]["committed"] == []
    assert f"on {ray_hosts.address(2)}) silent" in got["sync"]["failed"]["rollout-1"]
    assert "lost receiver 'rollout-1'" in got["sync"]["failed"]["rollout-0"]
    assert "lost receiver 'rollout-1'" in got["rollout-0"]["error"]
    assert got["serves"] == {"rollout-0": {"version": got["version"] - 1, "bit_exact": True}}
    assert nxt["state"] == "COMMITTED" and nxt["applied"] == {"rollout-0": got["version"] + 1}
    assert nxt["serves"] == {"rollout-0": {"version": got["version"] + 1, "bit_exact": True}}


def test_hostile_clients_on_another_host_cost_the_coordinator_little_and_versions_commit(job):
    """200 clients without the token on host 2 idle on the coordinator's control channel and 24
    stream 64 MiB frames into it: the coordinator grows by less than 64 MiB (it reads no frame
    before the token) while two versions commit on both hosts, bit-exact."""
    got = job["hostile"]
    print(f"\nhostile clients: the coordinator grew by {got['grown'] / 2**20:.1f} MiB")
    assert got["grown"] < 64 * 2**20
    for v in got["versions"]:
        assert v["state"] == "COMMITTED" and v["failed"] == {}
        assert all(s["bit_exact"] for s in v["serves"].values()) and len(v["serves"]) == 2


def test_close_leaves_no_namespace_link_process_or_mount(ray_hosts, net):
    for cluster in (ray_hosts, net):
        cluster.close()
        assert cluster.leftovers() == []


def test_the_bench_between_hosts_relays_one_copy_per_host_and_verifies_every_row(can_build, tmp_path):
    """``weightsync bench --hosts 3``, small: relay and Ray's object store for 1 receiving host x 1
    rollout and 2 hosts x 2, the second rollout of each host a follower reading its host's copy.
    Every row bit-exact; the relay sends about one payload out of host 0 for 4 rollouts on 2
    hosts, the object store one to one per host; nothing of the cluster is left."""
    out = tmp_path / "hosts.json"
    proc = subprocess.run([PYTHON, "-m", "weightsync.cli", "bench", "--hosts", "3", "--link-gbit", "2",
                           "--model", "tiny", "--bucket-mb", "0.25", "--rounds", "1", "--versions", "2",
                           "--host-rows", "relay", "ray-numpy", "--json", str(out), "--no-progress"],
                          cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    got = json.loads(out.read_text())
    rows = {(r["case"], r["row"]): r for r in got["rows"]}
    assert set(rows) == {(c, r) for c in ("1x1", "2x2") for r in ("relay", "ray-numpy")}
    assert all(r["verified"] and not r["errors"] for r in rows.values())
    assert rows[("2x2", "relay")]["transport"] == "relay"
    assert rows[("2x2", "relay")]["payloads_sent"][0] <= 1.2
    # Ray's object manager pulls from any node that holds a copy: the second host may take it
    # from the first, so host 0 sends between one payload and one per host
    assert 0.9 <= rows[("2x2", "ray-numpy")]["payloads_sent"][0] <= 2.2
    assert got["leftovers"] == []


@pytest.mark.slow
@pytest.mark.scenario("fault", "the coordinator's host cut off until the receivers fail on their own "
                      "(isolated hosts; slow, about 4 min)", transport="relay", promise=(
    "known limit: with connect_timeout_s 10, trainer held before tensor 3 of v, both rollouts past 2 load calls, "
    "host 0's link cut and left cut: each rollout fails only once its control calls to the coordinator have "
    "timed out one after another (get_state, bcast_failed, resource accounting, report: each waits "
    "connect_timeout_s + 5 s or more), later than sync_timeout_s after the cut, with DeadlineExceeded naming the "
    "coordinator ('did not answer'); it serves v - 1 bit-exact; link restored: the next version commits on both"))
def test_receivers_cut_off_from_the_coordinator_fail_when_their_control_calls_time_out(can_build):
    cluster = Cluster(hosts=3, link_gbit=LINK_GBIT, env=JOB_ENV)
    try:
        out = Driver(cluster, ["placement", "coordinator_cut_long"],
                     env={"WS_CONNECT_TIMEOUT_S": "10", "WS_CUT_LIMIT_S": "240"}).run(550)
    finally:
        cluster.close()
    assert cluster.leftovers() == []
    got, nxt = out["coordinator_cut_long"]["v"], out["coordinator_cut_long"]["next"]
    cut_at = got["cut"]["at"]
    assert sorted(got["outcomes_while_cut"]) == ["1", "2"], "both failed before the link came back"
    for host in ("1", "2"):
        outcome = got["outcomes_while_cut"][host]
        print(f"\nrollout on host {host} failed {outcome['at'] - cut_at:.1f} s after the cut: {outcome['error']}")
        assert outcome["at"] - cut_at > SYNC_TIMEOUT_S
        assert outcome["error"].startswith("DeadlineExceeded: ") and "did not answer" in outcome["error"]
    assert got["state"] == "ABORTED"
    assert got["serves"] == {n: {"version": got["version"] - 1, "bit_exact": True} for n in ("rollout-0", "rollout-1")}
    assert nxt["state"] == "COMMITTED"
    assert nxt["serves"] == {n: {"version": got["version"] + 1, "bit_exact": True} for n in ("rollout-0", "rollout-1")}


# -- sharded sending between hosts: weightsync bench --hosts 4 --trainer-ranks 2x2 ------------

@pytest.fixture(scope="module")
def hosts_ranks(can_build, tmp_path_factory):
    """``weightsync bench --hosts 4 --trainer-ranks 2x2``, small: 2 trainer hosts of 2 ranks (one
    gloo group over all 4, Shard(0) DTensors), 1 receiver on each of hosts 2 and 3, relay, links 1
    Gbit/s; the tiny-uneven layout (4 MiB, first dims 4 ranks split unevenly, one with fewer rows
    than ranks, a 0-dim tensor); one warm-up and 2 timed versions of each row (5 rows: gather, shards on
    relay and on broadcast, and the ray-numpy and ray-rdt-gloo baselines). About 60 s on 2 cores."""
    out = tmp_path_factory.mktemp("hosts-ranks") / "hosts-ranks.json"
    proc = subprocess.run([PYTHON, "-m", "weightsync.cli", "bench", "--hosts", "4", "--trainer-ranks", "2x2",
                           "--link-gbit", "1", "--model", "tiny-uneven", "--bucket-mb", "0.25", "--rounds", "1",
                           "--versions", "2", "--warmup", "1", "--json", str(out), "--no-progress"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    failed = [(r["name"], r["error"]) for r in json.loads(out.read_text())["rows"]
              if r["error"] or not r["verified"]] if out.exists() else []
    assert proc.returncode == 0, (failed, proc.stdout[-3000:], proc.stderr[-3000:])
    got = json.loads(out.read_text())
    assert got["layout"]["uneven"] and got["placement"]["rank_hosts"] == [0, 0, 1, 1] and \
        got["placement"]["receiver_hosts"] == [2, 3] and got["leftovers"] == [], got
    return got


def test_trainer_ranks_on_two_hosts_every_version_of_every_row_bit_exact_on_both_rollout_hosts(hosts_ranks):
    seen = {r["name"]: [v["bit_exact"] for v in r["versions"]] for r in hosts_ranks["rows"]}
    # the warm-up and 2 timed versions of each row, each checked on the receivers of host 2 and host 3;
    # ray-numpy and ray-rdt-gloo: every rank's rows through Ray, joined on the receivers (uneven shards,
    # a tensor with fewer rows than ranks and the 0-dim one, from rank 0 only, included)
    assert seen == {"gather": [[True, True]] * 3, "shards": [[True, True]] * 3,
                    "shards-broadcast": [[True, True]] * 3, "ray-numpy": [[True, True]] * 3,
                    "ray-rdt-gloo": [[True, True]] * 3}
    assert [r["kind"] for r in hosts_ranks["rows"]] == ["weightsync"] * 3 + ["baseline"] * 2


@pytest.mark.parametrize("row", ["shards", "shards-broadcast"])
def test_trainer_ranks_on_two_hosts_send_their_own_rows_once_and_each_rollout_host_takes_one_payload(hosts_ranks, row):
    """The shards rows: no rank gathers; each trainer host's link carries its own ranks' rows once
    to each of the 2 rollout hosts (relay: both receiving hosts are heads; broadcast: gloo's root
    sends to each member), within 10 % (headers, control calls); each rollout host takes in one
    payload and passes none on."""
    shards = next(r for r in hosts_ranks["rows"] if r["name"] == row)
    share = hosts_ranks["trainer_host_share"]
    print(f"\n{row}: out of the trainer hosts {shards['trainer_hosts_out']} payloads (their rows: {share}), into the "
          f"rollout hosts {shards['receiving_hosts_in']}")
    assert shards["transport"] == {"shards": "relay", "shards-broadcast": "broadcast"}[row]
    assert shards["sharded"] == [True] * 4
    assert all(out <= 1.1 * 2 * s for out, s in zip(shards["trainer_hosts_out"], share, strict=True)), (
        shards["trainer_hosts_out"], share)
    assert all(n <= 1.1 for n in shards["receiving_hosts_in"]), shards["receiving_hosts_in"]
    assert all(n <= 0.05 for n in shards["payloads_sent"][2:]), shards["payloads_sent"]
