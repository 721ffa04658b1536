"""Fault injection with real Ray actors and real processes, one specified outcome per fault
and transport. Each scenario's ``promise`` (per transport) is what docs/reliability.md shows
next to the result; the test asserts exactly that: who raises, naming whom, which version
each receiver serves after (bit-exact), the coordinator's record, and what the next version
does. Faults land at fault points the parties signal (tests/faultjob.py), never after a sleep.

Receiver and sender deaths in the middle of a broadcast live in test_broadcast.py (and, for
delta versions, test_delta_sync.py): gloo sends only into a receive the peer has posted, so the
sender runs at most the posted buckets ahead of a dead member, whatever the bucket size.
"""

from __future__ import annotations

import os
import signal

import pytest
import ray
from faultjob import DEADLINE_S, RECEIVERS, Job, apply_fails, survivor_commits, sync_failed, wait_until
from weightsync_bench.layouts import layout

from weightsync import transports

ALL = [t for t in ("shm", "ipc", "broadcast") if t in transports.names()]
STORAGE_OR_POINT_TO_POINT = [t for t in ("shm", "ipc") if t in transports.names()]
MANIFEST = layout("tiny")  # 7 buckets of 64 KiB
MID_TENSOR = len(MANIFEST) // 2


@pytest.fixture(scope="module")
def transport(request):
    return request.param


@pytest.fixture(scope="module")
def job(ray_cluster, transport):
    j = Job(transport, MANIFEST, bucket_mb=1 / 16)
    yield j
    j.close()


SURVIVOR_COMMITS = ("the sender's sync raises SyncFailed naming only rollout-1 ({why}); rollout-0 commits v and "
                    "serves it; the coordinator records v ABORTED with committed [rollout-0]; {then}")
WITHOUT_IT = "v+1 goes on without rollout-1 and commits; a restarted rollout-1 takes part in the next version"
KILLED_BEFORE_THE_BARRIER = ("stage() packs nothing here (the bytes move at the barrier): killed after stage(), "
                             "before sync(); both receivers raise naming trainer-0 (silent){how} serve v-1; "
                             "v ABORTED; a restarted trainer's next version commits on both")
CORRUPTED = ("both receivers raise ChecksumError naming the middle bucket{how}; the sender's SyncFailed names both; "
             "v ABORTED; the next clean version commits{then}")


@pytest.mark.scenario("fault", "receiver killed between versions (seen dead before the barrier)",
                      promise=SURVIVOR_COMMITS.format(why="silent", then=WITHOUT_IT))
@pytest.mark.parametrize("transport", ALL, indirect=True)
def test_receiver_killed_between_versions(job):
    base = job.fresh()
    job.kill("rollout-1")
    job.wait_seen("rollout-1", alive=False)
    assert job.state(base) == "COMMITTED", "a committed version stays committed"
    v = job.next()
    survivor_commits(job, v, job.rollouts["rollout-0"].apply.remote(v), job.trainer.step.remote(v), "silent")
    # the fault persists: the next version goes on without the dead receiver
    v = job.next()
    assert job.step(v, ["rollout-0"]) == {"rollout-0": v} and job.state(v) == "COMMITTED"
    assert job.next_serves_all(restart="rollout-1")


@pytest.mark.scenario("fault", "receiver killed after loading bucket k of v (first / middle / last)",
                      promise=SURVIVOR_COMMITS.format(
                          why="silent", then="a restarted rollout-1 takes part in the next version"))
@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("transport", STORAGE_OR_POINT_TO_POINT, indirect=True)
def test_receiver_killed_at_bucket(job, where):
    """Both receivers stop after bucket k; rollout-1 is killed there, rollout-0 goes on once
    the coordinator has seen the death (shm: it reads the segment on its own; ipc: the
    sender stops waiting for a receiver declared dead)."""
    _, v, applied, sync = job.kill_held("rollout-1", where)
    survivor_commits(job, v, applied["rollout-0"], sync, "silent")
    assert job.next_serves_all(restart="rollout-1")


@pytest.mark.scenario("fault", "sender killed while staging v", promise={
    "shm": "held before the middle tensor, the segment half written: both receivers raise naming trainer-0 "
           "(silent), roll back to v-1 from its segment and serve it; v ABORTED; a restarted trainer's next "
           "version commits on both",
    "ipc": KILLED_BEFORE_THE_BARRIER.format(how=" before loading anything and"),
    "broadcast": KILLED_BEFORE_THE_BARRIER.format(how=" and")})
@pytest.mark.parametrize("transport", ALL, indirect=True)
def test_sender_killed_while_staging(job, transport):
    base = job.fresh()
    v = job.next()
    applied = [r.apply.remote(v) for r in job.rollouts.values()]
    if transport == "shm":
        ray.get(job.trainer.hold_at.remote(MID_TENSOR))
        job.trainer.stage.remote(v)
        assert ray.get(job.trainer.reached.remote(DEADLINE_S))
        assert job.state(v) == "STAGING"
    else:
        ray.get(job.trainer.stage.remote(v))
        assert job.state(v) == "STAGED"
    job.kill("trainer")
    for ref in applied:
        apply_fails(ref, "trainer-0", "silent")
    assert [job.serves(n) for n in RECEIVERS] == [base, base], "rolled back or untouched, never torn"
    m = job.metrics(v)
    assert m.state == "ABORTED" and "trainer-0" in m.reason and m.committed == []
    assert job.next_serves_all(restart="trainer")


@pytest.mark.scenario("fault", "sender killed after both receivers loaded bucket k of v (first / middle / last)",
                      promise={
    "shm": "the whole version is in the segment before the barrier: both receivers commit v and serve it; the "
           "coordinator records v COMMITTED (latest_committed v) though the sender died; a restarted trainer's "
           "next version commits on both",
    "ipc": "first / middle bucket: both receivers raise naming trainer-0 (silent) and serve nothing (ipc keeps "
           "no copy of v-1 to roll back to) until the next version; last bucket: every byte arrived, both "
           "serve v, while the coordinator, which aborted v when the sender went silent, keeps v ABORTED with "
           "both listed committed; either way a restarted trainer's next version commits on both"})
@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("transport", STORAGE_OR_POINT_TO_POINT, indirect=True)
def test_sender_killed_at_bucket(job, transport, where):
    job.fresh()
    v, k = job.next(), job.bucket_at(where)
    applied = list(job.start_held(v, k)[0].values())
    wait_until("v is at the barrier", lambda: job.state(v) == "TRANSFERRING")
    job.kill("trainer")
    if transport != "shm":
        wait_until("the coordinator aborted v", lambda: job.state(v) == "ABORTED")
    ray.get([r.release.remote() for r in job.rollouts.values()])
    if transport == "shm":
        assert ray.get(applied) == [v, v] and job.state(v) == "COMMITTED"
        assert job.coord.status().latest_committed == v
        assert [job.serves(n) for n in RECEIVERS] == [v, v]
    elif where == "last":
        assert ray.get(applied) == [v, v] and [job.serves(n) for n in RECEIVERS] == [v, v]
        m = job.metrics(v)
        assert m.state == "ABORTED" and "trainer-0" in m.reason and sorted(m.committed) == list(RECEIVERS)
    else:
        for ref in applied:
            apply_fails(ref, "trainer-0", "silent")
        assert [job.serves(n) for n in RECEIVERS] == [None, None]
        m = job.metrics(v)
        assert m.state == "ABORTED" and m.committed == []
        assert all("serves no version until the next sync" in m.failed[n] for n in RECEIVERS), m.failed
    assert job.next_serves_all(restart="trainer")


@pytest.mark.scenario("fault", "receiver stalled past heartbeat_timeout_s (SIGSTOP before the barrier, later SIGCONT)",
                      promise=SURVIVOR_COMMITS.format(
                          why="silent: dead or stalled",
                          then="once resumed, rollout-1 still serves v-1 and takes part in the next version"))
@pytest.mark.parametrize("transport", ALL, indirect=True)
def test_receiver_stalled_then_resumed(job):
    base = job.fresh()
    pid = ray.get(job.rollouts["rollout-1"].pid.remote())
    os.kill(pid, signal.SIGSTOP)
    try:
        job.wait_seen("rollout-1", alive=False)
        v = job.next()
        survivor_commits(job, v, job.rollouts["rollout-0"].apply.remote(v), job.trainer.step.remote(v), "stalled")
    finally:
        os.kill(pid, signal.SIGCONT)
    job.wait_seen("rollout-1", alive=True)  # its heartbeats resumed
    assert job.serves("rollout-1") == base, "the stalled receiver still holds a complete version"
    assert job.next_serves_all()


@pytest.mark.scenario("fault", "bucket corrupted in transit (one byte flipped after its checksum)", promise={
    "shm": CORRUPTED.format(how=", roll back to v-1 from its segment and serve it", then=""),
    "ipc": CORRUPTED.format(how=" and serve nothing (no copy of v-1 to roll back to) until the next version",
                            then=""),
    "broadcast": CORRUPTED.format(how=" (one may learn it from the other through the aborted group) and serve "
                                      "nothing until the next version", then=" over a re-formed group")})
@pytest.mark.parametrize("transport", ALL, indirect=True)
def test_corrupted_bucket_is_not_applied(job, transport):
    _tampered(job, transport, "corrupt", job.bucket_at("middle"))


@pytest.mark.scenario("fault", "bucket truncated in transit (second half of the last bucket lost)", promise={
    "shm": "both receivers raise ChecksumError naming the last bucket, roll back to v-1 and serve it; SyncFailed "
           "names both; v ABORTED; the next clean version commits",
    "ipc": "both receivers raise ChecksumError naming the last bucket and serve nothing until the next version; "
           "SyncFailed names both; v ABORTED; the next clean version commits",
    "broadcast": "both receivers raise ChecksumError naming the last bucket and serve nothing until the next "
                 "version; SyncFailed names both; v ABORTED; the next clean version commits"})
@pytest.mark.parametrize("transport", ALL, indirect=True)
def test_truncated_bucket_is_not_applied(job, transport):
    _tampered(job, transport, "truncate", job.bucket_at("last"))


def _tampered(job: Job, transport: str, how: str, k: int) -> None:
    base = job.fresh()
    v = job.next()
    ray.get(job.trainer.tamper.remote(v, k, how))
    applied = [r.apply.remote(v) for r in job.rollouts.values()]
    err = sync_failed(job.trainer.step.remote(v))
    assert set(err.failed) == set(RECEIVERS) and err.committed == [], (err.committed, err.failed)
    for why in err.failed.values():
        assert "ChecksumError" in why and f"bucket {k} of version {v}" in why, why
    for ref in applied:
        apply_fails(ref, "ChecksumError", f"bucket {k} of version {v}")
    kept = base if transport == "shm" else None
    assert [job.serves(n) for n in RECEIVERS] == [kept, kept]
    if transport == "shm":
        assert all(f"rolled back to version {base}" in why for why in err.failed.values())
    assert job.state(v) == "ABORTED"
    assert job.next_serves_all()


@pytest.mark.scenario("fault", "receiver restarted with an empty model catches up", promise={
    "shm": "the replacement catches up to the latest committed version from its segment without the trainer, "
           "then takes part in the next version",
    "ipc": "ipc keeps no version: the replacement serves nothing until the next version, which it takes part in",
    "broadcast": "broadcast keeps no version: the replacement serves nothing until the next version, which it "
                 "takes part in"})
@pytest.mark.parametrize("transport", ALL, indirect=True)
def test_restarted_receiver_catches_up(job, transport):
    base = job.fresh()
    job.kill("rollout-1")
    fresh = job.restart("rollout-1")  # registers at once: takes the name from the dead one
    assert ray.get(fresh.version.remote()) is None
    assert ray.get(fresh.apply.remote(None, None, False)) == (base if transport == "shm" else None)
    assert job.serves("rollout-1") == (base if transport == "shm" else None)
    assert job.next_serves_all()


@pytest.mark.scenario("fault", "coordinator killed and restarted by Ray", promise=(
    "every party re-registers with the new incarnation; the next version commits on both receivers; status "
    "lists both receivers and latest_committed is that version; an older version number is refused"))
@pytest.mark.parametrize("transport", ALL, indirect=True)
def test_coordinator_killed_and_restarted(job):
    base = job.fresh()
    before = job.coord.status().session
    ray.kill(job.coord.actor, no_restart=False)  # Ray restarts it with an empty session
    wait_until("every party re-registered with the new coordinator", lambda: (
        (s := job.coord.status()).session != before
        and sorted(p.name for p in s.parties if p.alive) == sorted([*RECEIVERS, "trainer-0"])))
    assert job.next_serves_all()
    status = job.coord.status()
    assert status.latest_committed == job.v and len([p for p in status.parties if p.role == "receiver"]) == 2
    with pytest.raises(Exception, match="goes backwards|is reused"):
        ray.get(job.trainer.stage.remote(base))


def test_party_ids_from_before_a_coordinator_restart_are_not_reused(coordinator_factory):
    """Found chasing the intermittent restart failure: ids restarted at 1 with each
    incarnation, so a party still holding old id 1 passed for whoever re-registered first."""
    from weightsync.coordinator.client import ControlPlane
    from weightsync.errors import SessionLost

    coord = coordinator_factory({"transport": "shm", "bucket_mb": 1 / 16})
    who = {"role": "receiver", "rank": 0, "host": "h", "os_pid": os.getpid()}
    old = {n: coord.register(name=n, **who).party for n in ("a", "b")}
    before = coord.status().session
    ray.kill(coord.actor, no_restart=False)
    wait_until("Ray brought the coordinator back", lambda: coord.status().session != before, timeout=60)
    new_b = coord.register(name="b", **who).party
    assert new_b not in old.values()
    with pytest.raises(SessionLost):
        ControlPlane(coord, lambda: old["a"]).heartbeat(rpc_timeout=5.0)  # 'a' must notice and register again
