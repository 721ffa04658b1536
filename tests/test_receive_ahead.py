"""receive_ahead on broadcast (gloo): a version's bytes travel in stage(), into every
receiver's ahead copy, verified there, while the engines still serve the version before; the
barrier only loads. Real Ray actors, a real gloo group; faults land at fault points."""

from __future__ import annotations

import pytest
import ray
from faultjob import DEADLINE_S, RECEIVERS, Job, apply_fails, sync_failed, wait_until
from weightsync_bench.layouts import layout

from weightsync.config import SyncConfig
from weightsync.errors import CapacityError, ConfigError
from weightsync.manifest import plan_buckets
from weightsync.transports.broadcast.ahead import AheadCopy

TINY = layout("tiny")
BUCKET_MB = 48 / 1024  # 7+ buckets, tensors split over three of them
MID_TENSOR = len(TINY) // 2


@pytest.fixture(scope="module")
def job(ray_cluster):
    j = Job("broadcast", TINY, bucket_mb=BUCKET_MB, receive_ahead="on")
    yield j
    j.close()


def ahead_ready(job: Job) -> None:
    """Every rollout's ahead thread waits at the coordinator (it starts with the session, at
    the first apply), so the next version goes ahead rather than at the barrier."""
    wait_until("every receiver is ready ahead", lambda: all(getattr(job.party(n), "ahead", False) for n in RECEIVERS))


def loads(job: Job) -> list[int]:
    return [ray.get(job.rollouts[n].counters.remote()).loads for n in RECEIVERS]


def test_versions_travel_before_the_barrier_bit_exact(job):
    """Version after version with 2 receivers: stage() returns with the bytes in both ahead copies
    (verified), the engines untouched and serving v-1 bit for bit; the barrier loads v from
    the ahead copy, bit-exact, with no collective at the barrier."""
    job.fresh()
    ahead_ready(job)
    for _ in range(3):
        base, v = job.v, job.next()
        before = loads(job)
        ray.get(job.trainer.stage.remote(v), timeout=60)
        assert job.state(v) == "STAGED" and job.metrics(v).info.get("ahead") is True
        assert [ray.get(job.rollouts[n].prefetch.remote(v), timeout=60) for n in RECEIVERS] == [v, v]
        assert loads(job) == before and [job.serves(n) for n in RECEIVERS] == [base, base]
        applied = [job.rollouts[n].apply.remote(v) for n in RECEIVERS]
        ray.get(job.trainer.sync.remote(v), timeout=60)
        assert ray.get(applied, timeout=60) == [v, v] and [job.serves(n) for n in RECEIVERS] == [v, v]
        m = job.metrics(v)
        assert all(m.receivers[n].received_ahead for n in RECEIVERS), m.receivers
        assert m.digest is not None and set(m.receiver_digests.values()) == {m.digest}


@pytest.mark.scenario("fault", "bucket corrupted on the wire while v travels ahead (receive_ahead)",
                      transport="broadcast", promise=(
                          "both ahead copies refuse the middle bucket before the barrier; at the barrier both receivers "
                          "raise ChecksumError naming it and load nothing (engines untouched, serving v-1); the "
                          "sender's SyncFailed names both; v ABORTED; the next version travels ahead and commits"))
def test_corrupt_bucket_ahead_leaves_the_engine_untouched(job):
    base = job.fresh()
    ahead_ready(job)
    v = job.next()
    bucket = job.buckets // 2
    ray.get(job.trainer.tamper.remote(v, bucket, "corrupt"))
    before = loads(job)
    ray.get(job.trainer.stage.remote(v), timeout=60)
    assert [ray.get(job.rollouts[n].prefetch.remote(v), timeout=60) for n in RECEIVERS] == [None, None]
    applied = [job.rollouts[n].apply.remote(v) for n in RECEIVERS]
    err = sync_failed(job.trainer.sync.remote(v))
    assert set(err.failed) == set(RECEIVERS) and err.committed == []
    for n in RECEIVERS:
        assert "ChecksumError" in err.failed[n] and f"bucket {bucket}" in err.failed[n], err.failed[n]
    for ref in applied:
        apply_fails(ref, "ChecksumError", f"bucket {bucket}")
    assert loads(job) == before and [job.serves(n) for n in RECEIVERS] == [base, base]
    assert job.state(v) == "ABORTED"
    assert job.next_serves_all()


@pytest.mark.scenario("fault", "sender killed while v travels ahead (receive_ahead)", transport="broadcast",
                      promise=("held before the middle tensor, half the buckets in the ahead copies: both receivers raise "
                               "naming trainer-0 and load nothing (engines untouched, serving v-1); v ABORTED naming "
                               "trainer-0; a restarted trainer's next version commits on both"))
def test_sender_killed_ahead_leaves_the_engine_untouched(job):
    base = job.fresh()
    ahead_ready(job)
    v = job.next()
    before = loads(job)
    ray.get(job.trainer.hold_at.remote(MID_TENSOR))
    job.trainer.stage.remote(v)
    assert ray.get(job.trainer.reached.remote(DEADLINE_S))
    assert job.state(v) == "STAGING" and job.metrics(v).info.get("ahead") is True
    job.kill("trainer")
    wait_until("the coordinator aborted v", lambda: job.state(v) == "ABORTED")
    applied = [job.rollouts[n].apply.remote(v) for n in RECEIVERS]
    for ref in applied:
        apply_fails(ref, "trainer-0")
    assert "trainer-0" in job.metrics(v).reason, job.metrics(v).reason
    assert loads(job) == before and [job.serves(n) for n in RECEIVERS] == [base, base]
    assert job.next_serves_all(restart="trainer")


def test_shm_versions_are_verified_ahead_and_the_barrier_hashes_nothing(ray_cluster):
    """shm: the segment is the ahead copy; each receiver's ahead thread verifies a staged version
    before the barrier, so apply() only loads: every bucket's digest was checked already."""
    j = Job("shm", TINY, bucket_mb=BUCKET_MB, receive_ahead="on")
    try:
        j.fresh()
        ahead_ready(j)
        v = j.next()
        ray.get(j.trainer.stage.remote(v), timeout=60)
        assert [ray.get(j.rollouts[n].prefetch.remote(v), timeout=60) for n in RECEIVERS] == [v, v]
        applied = [j.rollouts[n].apply.remote(v) for n in RECEIVERS]
        ray.get(j.trainer.sync.remote(v), timeout=60)
        assert ray.get(applied, timeout=60) == [v, v] and [j.serves(n) for n in RECEIVERS] == [v, v]
        m = j.metrics(v).receivers
        assert all(m[n].received_ahead and m[n].peer_verified_buckets == j.buckets for n in RECEIVERS), m
    finally:
        j.close()


def test_receive_ahead_on_a_transport_that_moves_bytes_at_the_barrier_is_refused(coordinator_factory):
    """Streaming shm (a ring, as ipc) moves a version in sync(): `on` there fails the first
    stage, saying why and what works."""
    from weightsync_bench.layouts import materialize

    from weightsync import WeightSender

    coord = coordinator_factory({"transport": "shm", "shm_budget_mb": 0.25, "receive_ahead": "on",
                                 "bucket_mb": BUCKET_MB})
    with WeightSender(coord) as sender:
        with pytest.raises(ConfigError, match="receive_ahead: on, but transport shm \\(shm streaming.* takes versions at the barrier "
                                              "only; use broadcast or whole-version shm, or receive_ahead: auto"):
            sender.stage(1, materialize(TINY, seed=1))


def test_an_ahead_copy_that_does_not_fit_is_refused_with_its_sizes():
    plan = plan_buckets(TINY, SyncConfig(bucket_mb=BUCKET_MB).bucket_bytes)
    cfg = SyncConfig(bucket_mb=BUCKET_MB, receive_ahead="on", receive_ahead_max_mb=0.1)
    with pytest.raises(CapacityError, match=r"receiver 'r': receive_ahead needs an ahead copy of 0\.\d+ MiB .* may take "
                                            r"0\.1 MiB \(receive_ahead_max_mb=0\.1\)"):
        AheadCopy(plan, "cpu", "receiver 'r'", cfg)


@pytest.mark.parametrize("key, value", [("receive_ahead", "always"), ("receive_ahead_max_mb", -1)])
def test_receive_ahead_keys_are_validated(key, value):
    with pytest.raises(ConfigError, match=key):
        SyncConfig.from_mapping({key: value})
