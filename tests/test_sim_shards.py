"""Rows of a sharded version that live on an accelerator: each rank's copy of its rows into the
host segment has landed when RowWriter.fill returns (the last writer digests the bucket right
after), on the simulated asynchronous accelerator, whose copies run late on a stream."""

from __future__ import annotations

import pytest
import ray
import test_shards
import torch
from weightsync_bench.layouts import materialize

from faultjob import THREADED, sim_env
from support.parties import assert_same_weights, assert_serves, job_config, rollout_actor, stop_actors, wait_until
from support.shards import MANIFEST, sharded, sharded_trainers
from weightsync import device as devices
from weightsync.errors import VersionError, WeightSyncError
from weightsync.manifest import RowWriter, Unpacker, plan_buckets, plan_rows

pytestmark = pytest.mark.sim


@pytest.mark.parametrize("ranks", [2, 3])
def test_rows_copied_from_the_device_have_landed_when_fill_returns(ranks):
    dev = devices.resolve("sim")
    manifest = sharded(ranks)
    plan = plan_buckets(manifest, 4096, 256)
    full = materialize(MANIFEST, seed=7)
    buffers = [torch.zeros(b.nbytes, dtype=torch.uint8) for b in plan.buckets]
    for rank in range(ranks):
        local = [(s.name, (full[s.name][r[rank]: r[rank + 1]] if s.shape else full[s.name]).to(dev))
                 for s, r in zip(manifest.specs, manifest.rows)]
        writer = RowWriter(plan_rows(plan, manifest, rank), manifest, local)
        for b in writer.buckets:
            writer.fill(b, buffers[b])
    got = {}
    unpacker = Unpacker(plan, manifest)
    for b, buf in enumerate(buffers):
        got.update((n, t.clone()) for n, t in unpacker.unpack(b, buf))
    assert_same_weights(got, full, "rows copied from the simulated device")


SIM = {"transport": "broadcast", "backend": "auto", "bucket_mb": 1 / 32, "device": "sim"}


def _job(coordinator_factory, ranks: int, receivers: int = 2, receive_ahead: str = "off"):
    """A sharded broadcast job on the sim device, one simulated device per party (trainer rank r
    holds device r, receiver i device ranks + i), as the device collective needs."""
    cfg = job_config({**SIM, "receive_ahead": receive_ahead})
    coord = coordinator_factory(cfg)
    rollouts = [rollout_actor(coord, MANIFEST, f"rollout-{i}", i, cfg, {**THREADED, **sim_env(ranks + i)}, device="sim")
                for i in range(receivers)]
    trainers = sharded_trainers(coord, MANIFEST, ranks, cfg, receivers, options=lambda r: sim_env(r))
    return coord, rollouts, trainers


def test_each_rank_broadcasts_its_rows_over_the_device_collective_bit_exact(coordinator_factory):
    """Sharded broadcast with every party on the simulated accelerator: each rank's pieces packed
    into device buffers and broadcast over its own group of the device collective, each receiver
    putting them in place on the device and comparing the pieces' device digests at the end; at
    the barrier (version 1: no ahead thread is up yet), then with receive_ahead in every rank's
    stage() into the receivers' ahead copies, on their ahead threads' own streams (version 2)."""
    ranks = 3
    coord, rollouts, trainers = _job(coordinator_factory, ranks, receive_ahead="on")
    try:
        for v in (1, 2):
            test_shards._step(trainers, rollouts, v, late0=1.0 if v == 2 else 0.0)
            for r in rollouts:
                assert_serves(r, MANIFEST, v)
            m = coord.metrics(v)
            assert [m.info.get("ahead", False), *(r.received_ahead for r in m.receivers.values())] == \
                [v == 2] * 3, m
            if v == 1:
                wait_until("the receivers' ahead threads came up",
                           lambda: all(p.ahead for p in coord.status().parties if p.role == "receiver"), timeout=30)
        assert ray.get([t.sharded.remote() for t in trainers]) == [True] * ranks
        assert coord.status().group["backend"] == "simccl"  # the sim device's collective, not gloo
    finally:
        stop_actors([*trainers, *rollouts])


def test_rows_changed_on_the_device_abort_the_version_naming_the_rank(coordinator_factory):
    """The pieces' device digests are compared in one read at the version's end, before commit:
    a rank's rows whose digest is off abort the version naming the rank, and the receivers, which
    loaded its buckets already, serve nothing until the next version (as broadcast does for a bad
    device bucket, test_faults.test_corrupted_bucket_is_not_applied)."""
    coord, rollouts, trainers = _job(coordinator_factory, 3)
    try:
        test_shards._step(trainers, rollouts, 1)
        ray.get(trainers[1].corrupt_rows_digests.remote())
        applying = [r.apply.remote(2) for r in rollouts]
        steps = [t.step.remote(2) for t in trainers]
        with pytest.raises((VersionError, WeightSyncError), match="trainer rank 1's rows arrived with torch"):
            ray.get(steps[0], timeout=60)
        for r in applying:
            with pytest.raises(Exception, match="trainer rank 1's rows arrived with torch"):
                ray.get(r, timeout=60)
        ray.wait(steps[1:], num_returns=2, timeout=60)
        for r in rollouts:
            assert_serves(r, MANIFEST, None)
    finally:
        stop_actors([*trainers, *rollouts])
