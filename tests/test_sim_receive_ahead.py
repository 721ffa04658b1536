"""receive_ahead on broadcast with every party on the simulated accelerator (tests/sim/weightsync_sim):
the ahead copy in device memory, the collective (simccl) and the ahead copy's copies queued on the
ahead copy's own stream and landing late, the barrier's loads on the engine's stream waiting for
them through an event. The same functions as test_receive_ahead.py, so the same promised
outcome each: only the job differs (``device="sim"``, one device per party); and one outcome
only a device has: which stream the ahead transfer was queued on."""

from __future__ import annotations

import pytest
import ray
import test_receive_ahead as ahead
import torch
from faultjob import RECEIVERS, Job

from weightsync import device as devices
from weightsync.config import SyncConfig
from weightsync.device import resolve
from weightsync.manifest import plan_buckets
from weightsync.transports.broadcast.ahead import AheadCopy

pytestmark = pytest.mark.sim


@pytest.fixture(scope="module")
def job(ray_cluster):
    j = Job("broadcast", ahead.TINY, bucket_mb=ahead.BUCKET_MB, receive_ahead="on", device="sim")
    yield j
    j.close()


test_versions_travel_before_the_barrier_bit_exact = ahead.test_versions_travel_before_the_barrier_bit_exact
test_corrupt_bucket_ahead_leaves_the_engine_untouched = ahead.test_corrupt_bucket_ahead_leaves_the_engine_untouched
test_sender_killed_ahead_leaves_the_engine_untouched = ahead.test_sender_killed_ahead_leaves_the_engine_untouched


def test_the_ahead_transfer_is_queued_on_a_stream_of_its_own(job):
    """While v travels ahead (stage() returns with the bytes in both ahead copies), not one op is
    queued on the stream the engine loads on; the transfer's ops (a collective, a copy and a
    digest per bucket at least) are all on each receiver's ahead stream, another stream."""
    job.fresh()
    ahead.ahead_ready(job)
    v = job.next()
    before = {n: ray.get(job.rollouts[n].sim_queued.remote()) for n in RECEIVERS}
    ray.get(job.trainer.stage.remote(v), timeout=60)
    assert [ray.get(job.rollouts[n].prefetch.remote(v), timeout=60) for n in RECEIVERS] == [v, v]
    after = {n: ray.get(job.rollouts[n].sim_queued.remote()) for n in RECEIVERS}
    for n in RECEIVERS:
        assert after[n].ahead is not None and not after[n].same, after[n]
        queued = {"engine": after[n].engine - before[n].engine, "ahead": after[n].ahead - before[n].ahead}
        assert queued["engine"] == 0 and queued["ahead"] >= 3 * job.buckets, (n, queued)


# the ahead copy alone runs on a real device too (device_check.sh: -m cuda / -m npu); skipped without one
KINDS = ["sim", pytest.param("cuda", marks=pytest.mark.cuda), pytest.param("npu", marks=pytest.mark.npu)]


@pytest.mark.parametrize("kind", KINDS)
def test_the_barrier_reads_each_version_after_it_landed_and_before_the_next_overwrites_it(kind):
    """The ahead copy alone, in one process: versions written on its stream, each read at once on an
    engine's stream, no host waiting on either (the events order them): every read holds the
    version written before it, bit for bit, not a stale or a later one (20 versions; on the
    sim every op lands 0-5 ms late)."""
    device = resolve(kind)
    cfg = SyncConfig(bucket_mb=ahead.BUCKET_MB, receive_ahead="on", device=kind)
    plan = plan_buckets(ahead.TINY, cfg.bucket_bytes, cfg.align_bytes)
    copy = AheadCopy(plan, device, "receiver 'r'", cfg)
    engine = devices.new_stream(device)
    try:
        reads = []
        for v in range(1, 21):
            with copy.writing():
                copy.begin(v)
                for b, bucket in enumerate(plan.buckets):
                    copy.bucket(b, bucket.nbytes).fill_(v)
                copy.finish(v, None)
            with devices.use_stream(device, engine):
                out = torch.empty(copy.nbytes, dtype=torch.uint8, device=device)
                for b, buf, *_ in copy.buckets(plan):
                    out[copy.bases[b]: copy.bases[b] + buf.numel()].copy_(buf)
            reads.append(out)
        engine.synchronize()
        got = [out.cpu() for out in reads]
    finally:
        if kind == "sim":  # its streams are threads
            engine.close()
            copy.stream.close()
    wrong = {v: sorted(set(host.tolist())) for v, host in enumerate(got, 1) if not bool((host == v).all())}
    assert wrong == {}
