"""``delta: auto`` in a real job (broadcast, real Ray actors): it times both ways, then sends the
faster one, and every version, whichever way it went, is bit-exact at every receiver with the
full sync's digest. Which way wins on this machine is the benchmark's business
(docs/delta.md), not this test's: the test asserts the ways the policy's own samples imply."""

from __future__ import annotations

import statistics

import pytest
import ray
from faultjob import RECEIVERS, Job
from test_delta_sync import ALL, BUCKET, FULL, MANIFEST, full_digest, serves, step

from weightsync.delta import policy as delta_policy


@pytest.fixture(scope="module")
def auto_job(ray_cluster):
    j = Job("broadcast", MANIFEST, bucket_mb=BUCKET / 2**20, delta="auto")
    yield j
    j.close()


def received(job: Job) -> list[int]:
    return [ray.get(job.rollouts[n].counters.remote()).metrics.bytes for n in RECEIVERS]


@pytest.mark.skipif("broadcast" not in ALL, reason="broadcast transport unavailable")
def test_auto_times_three_deltas_and_three_full_versions_then_sends_the_faster_way(auto_job):
    """Versions 1-7 go prime, three deltas, three full versions (a full version or a prime moves
    every byte, a delta under a quarter of them); then the way with the lower median: deltas
    (after a prime: the full versions dropped the base) or full versions. Every version commits
    on both receivers with the weights and the digest of a full sync."""
    job, moved = auto_job, []
    for v in range(1, 10):
        assert step(job, v) == {n: v for n in RECEIVERS}
        assert [serves(job, n) for n in RECEIVERS] == [v, v]
        metrics = [ray.get(job.rollouts[n].counters.remote()).metrics for n in RECEIVERS]
        assert {m.digest for m in metrics} == {full_digest(v)}, v
        moved.append("part" if max(m.bytes for m in metrics) < FULL / 4 else "whole")
        if v == 7:
            timed = ray.get(job.trainer.delta_state.remote())["auto"]
            assert len(timed["delta_s"]) == 3 and len(timed["full_s"]) == 3, timed
    faster = delta_policy.DELTA if statistics.median(timed["delta_s"]) < statistics.median(timed["full_s"]) else delta_policy.FULL
    assert ray.get(job.trainer.delta_state.remote())["auto"]["chosen"] == faster
    then = ["whole", "part"] if faster == delta_policy.DELTA else ["whole", "whole"]
    assert moved == ["whole"] + ["part"] * 3 + ["whole"] * 3 + then, (moved, faster)
