"""Soak (many versions: no growth, no leaks) and isolation / security between jobs."""

from __future__ import annotations

import os
import pickle
import re
import stat
import threading

import pytest
import ray
from support.parties import assert_serves, start_parties, wait_until
from weightsync_bench.layouts import layout, materialize

from weightsync import Coordinator, ProtocolError, WeightReceiver, records, transports
from weightsync.transports.shm.transport import SEGMENT_REF, holders, locate, our_segments

MANIFEST = layout("tiny")
CPU_TRANSPORTS = [t for t in ("shm", "ipc", "broadcast") if t in transports.names()]
SOAK_VERSIONS = int(os.environ.get("WSTEST_SOAK_VERSIONS", "300"))


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.slow  # minutes on a 2-core VM: outside the default run (pytest -m slow runs it)
@pytest.mark.parametrize("transport", CPU_TRANSPORTS)
def test_soak(coordinator_factory, transport, request):
    request.node.add_marker(pytest.mark.scenario("soak", f"{SOAK_VERSIONS} versions, 2 receivers"))
    cfg = {"transport": transport, "bucket_mb": 1 / 16}
    # its own teardown, not the actors fixture's: that the processes are gone is the test's outcome
    job = start_parties(coordinator_factory(cfg), MANIFEST, cfg, 2)
    coord, rs, trainer = job
    parties = job.parties
    pids = ray.get([p.pid.remote() for p in parties])
    rss, segments, resources = {}, {}, {}
    try:
        for v in range(1, SOAK_VERSIONS + 1):
            assert job.step(v)[0] == [v, v]
            if v in (20, SOAK_VERSIONS):
                rss[v] = ray.get([p.rss.remote() for p in parties])
                segments[v] = len(set(our_segments()) | {n for _, _, n in holders()})
                resources[v] = coord.status().resources
        assert_serves(rs[1], MANIFEST, SOAK_VERSIONS)
        for before, after in zip(rss[20], rss[SOAK_VERSIONS]):
            assert after < before * 1.05, f"resident memory grew {after / before - 1:.1%} after version 20"
        assert segments[20] == segments[SOAK_VERSIONS], "the segment count (files and memfds) is constant"
        assert resources[20] == resources[SOAK_VERSIONS], "open segments / handles are constant"
    finally:
        ray.get([p.close.remote() for p in parties])
        for p in parties:
            ray.kill(p)
    assert all(n == 0 for n in coord.status().resources.values()), "every segment and handle was closed"
    coord.shutdown()
    wait_until("no process of this job is left", lambda: all(_gone(pid) for pid in pids), timeout=30, interval=0.5)


@pytest.mark.scenario("security", "two jobs on one node sync concurrently without touching each other")
@pytest.mark.parametrize("transport", CPU_TRANSPORTS)
def test_two_jobs_are_isolated(start_job, transport):
    cfg = {"transport": transport, "bucket_mb": 1 / 16}
    jobs = [start_job(cfg, 1, MANIFEST) for _ in range(2)]
    errors = []

    def run(j, job):
        try:
            for v in range(1, 6):
                assert job.step(v, 1000 * j + v)[0] == [v]  # different weights per job
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(j, job)) for j, job in enumerate(jobs)]
    [th.start() for th in threads]
    [th.join(300) for th in threads]
    assert not errors, errors
    for j, job in enumerate(jobs):  # each serves its own job's weights, not the other's
        assert_serves(job.rollouts[0], materialize(MANIFEST, seed=1000 * j + 5), 5)
    names = [{str(v.info.get(k)) for v in c.status().versions for k in ("segment", "store", "rendezvous")
              if v.info.get(k)} for c, _, _ in jobs]
    assert not (names[0] & names[1]), f"jobs shared segments or rendezvous: {names[0] & names[1]}"
    assert jobs[0][0].status().session != jobs[1][0].status().session


@pytest.mark.scenario("security", "segments are 0600 with >= 128 random bits in the name", transport="shm")
@pytest.mark.parametrize("backing", ["files", "memfd"])
def test_segment_mode_and_name(start_job, backing):
    job = start_job({"transport": "shm", "bucket_mb": 1 / 16, "shm_backing": backing}, 1, MANIFEST)
    coord, (r,), t = job
    job.step(1)
    ref = coord.metrics(1).info["segment"]
    name = SEGMENT_REF.fullmatch(ref).group(1)
    st = os.stat(locate(ref, "/dev/shm"))  # a memfd: through /proc/<pid>/fd, its inode's mode
    assert stat.S_IMODE(st.st_mode) == 0o600
    m = re.fullmatch(r"wsync_\d+_([0-9a-f]+)", name)
    assert m and len(m.group(1)) * 4 >= 128
    if backing == "memfd":
        assert name not in os.listdir("/dev/shm"), "a memfd has no name in any file system"
        holding = {pid for pid, _, n in holders([name])}
        assert holding == set(ray.get([r.pid.remote(), t.pid.remote()])), "only the job's parties hold it"


@pytest.mark.scenario("security", "a memfd segment cannot be opened by another user", transport="shm")
@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another uid needs root")
def test_memfd_segment_needs_same_uid():
    """Opening /proc/<pid>/fd/<fd> needs ptrace-read access to the holder (same uid) and the
    memfd's 0600 mode: a process of another uid gets EACCES (root may: it is root)."""
    from weightsync import SyncConfig
    from weightsync.transports.shm.transport import create

    seg = create(SyncConfig(shm_backing="memfd"), 1 << 16, "a probe segment")
    try:
        path = locate(seg.ref, "/dev/shm")
        child = os.fork()  # no exec: the venv's interpreter may not be readable by that uid
        if child == 0:
            code = 1
            try:
                os.setgid(65534)
                os.setuid(65534)
                os.close(os.open(path, os.O_RDONLY))
                code = 0
            except PermissionError:
                code = 13
            finally:
                os._exit(code)
        _, status = os.waitpid(child, 0)
        assert os.waitstatus_to_exitcode(status) == 13, "uid 65534 was refused the segment"
    finally:
        seg.close()


@pytest.mark.scenario("security", "a pickle payload on the control plane is refused, not executed", transport="none")
def test_pickle_payload_is_refused(coordinator_factory, tmp_path):
    coord = coordinator_factory({})
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (os.mkdir, (str(marker),))

    payload = pickle.dumps(Exploit())
    with pytest.raises(ProtocolError):
        records.decode(payload)
    reply = records.decode(ray.get(coord.actor.rpc.remote(payload)))
    assert reply["ok"] is False and reply["kind"] == "ProtocolError" and "not valid msgpack" in reply["error"]
    # the same bytes wrapped as a msgpack extension type are refused too
    import msgpack

    wrapped = msgpack.packb({"op": "status", "token": coord.token, "args": msgpack.ExtType(1, payload)})
    reply = records.decode(ray.get(coord.actor.rpc.remote(wrapped)))
    assert reply["ok"] is False and "extension type" in reply["error"]
    assert not marker.exists(), "the payload never ran"


@pytest.mark.scenario("security", "a party presenting another session's token is refused")
def test_wrong_token_is_refused(coordinator_factory):
    coord = coordinator_factory({})
    other = coordinator_factory({})
    forged = Coordinator(coord.actor, coord.name, coord.namespace, other.token, coord.config)
    with pytest.raises(ProtocolError, match="wrong session token"):
        WeightReceiver(forged, lambda w: None, name="intruder")
    assert [p for p in coord.status().parties if p.name == "intruder"] == []


@pytest.mark.scenario("security", "the rendezvous store binds to the configured address only", transport="broadcast")
def test_rendezvous_store_binds_to_configured_address():
    import psutil
    import torch

    from weightsync import SyncConfig
    from weightsync.manifest import plan_buckets
    from weightsync.transports import TransportContext
    from weightsync.transports.broadcast.transport import BroadcastSender

    cfg = SyncConfig(transport="broadcast", backend="gloo", rendezvous_host="127.0.0.1")
    ctx = TransportContext(config=cfg, plan=plan_buckets(MANIFEST, cfg.bucket_bytes, cfg.align_bytes),
                           manifest=MANIFEST, digest=MANIFEST.digest(), session="t", name="trainer-0", rank=0,
                           device=torch.device("cpu"))
    sender = BroadcastSender(ctx)
    try:
        info = sender.session
        listening = [c.laddr for c in psutil.Process().net_connections(kind="tcp")
                     if c.status == psutil.CONN_LISTEN and c.laddr.port == info.port]
        assert info.host == "127.0.0.1"
        assert listening and all(a.ip == "127.0.0.1" for a in listening), listening
    finally:
        sender.close()
