"""Hosts that share nothing, on this machine (tests/hostnet.py): network namespaces on a bridge,
each host with its own address, /dev/shm and /tmp, links limited with tbf both ways. Needs root;
elsewhere every test here skips and says why (tests/test_multinode.py, three raylets sharing
one host, stays the fallback). Marked ``hosts``: the hosts tier runs them
(``bash scripts/tiers/hosts.sh``), the default run leaves them out.

The cluster itself: namespaces only (isolation, the link's rate and counters, cut and restore,
teardown), then a Ray cluster of 3 hosts (a task placed on host 2 runs there).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from hostnet import Cluster, available

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON = sys.executable
LINK_GBIT = 2.0  # the job's links
HEARTBEAT_TIMEOUT_S = 3.0  # tests/hostjob.py's CFG
SYNC_TIMEOUT_S = 30.0
# Ray's own health checks must outlast a cut host: 100 missed checks (5 min) before the GCS
# declares a node dead, 5 min before a raylet cut off from the GCS gives up
RAY_PATIENCE = {"RAY_health_check_failure_threshold": "100", "RAY_gcs_rpc_server_reconnect_timeout_s": "300"}
JOB_ENV = {"PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]), **RAY_PATIENCE}

pytestmark = pytest.mark.hosts


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


def test_close_leaves_no_namespace_link_process_or_mount(ray_hosts, net):
    for cluster in (ray_hosts, net):
        cluster.close()
        assert cluster.leftovers() == []

