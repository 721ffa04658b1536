"""Every trainer rank sends its own rows (a sharded session): FSDP2 shards (DTensors, Shard(0)) on
real gloo ranks, uneven splits included, written straight into the host's segment by each rank;
the receivers load whole tensors, bit-exact. Elsewhere (a transport that takes no rows) the shards
are gathered, as full_tensor() did before. A rank lost mid-version aborts it, named, on each."""

from __future__ import annotations

import pytest
import ray
import torch

from support.parties import assert_serves, rollout_actor, stop_actors, wait_until
from support.shards import MANIFEST, sharded, sharded_trainers
from weightsync.errors import ProtocolError, VersionError, WeightSyncError
from weightsync.manifest import plan_buckets, plan_rows, row_bytes

CFG = {"transport": "shm", "bucket_mb": 1 / 32}


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_every_byte_is_written_by_exactly_one_rank(ranks):
    manifest = sharded(ranks)
    plan = plan_buckets(manifest, 4096, 256)
    seen = {b.index: torch.zeros(b.nbytes, dtype=torch.int32) for b in plan.buckets}
    rows = [plan_rows(plan, manifest, r) for r in range(ranks)]
    for r, rp in enumerate(rows):
        for b, pieces in rp.pieces.items():
            for p in pieces:
                seen[b][p.offset: p.offset + p.nbytes] += 1
                lo = manifest.rows[p.tensor][r] * row_bytes(manifest[p.tensor])
                assert lo + p.src + p.nbytes <= manifest.rows[p.tensor][r + 1] * row_bytes(manifest[p.tensor])
    for bucket in plan.buckets:
        covered = torch.zeros(bucket.nbytes, dtype=torch.int32)
        for s in bucket.slices:
            covered[s.offset: s.offset + s.nbytes] = 1
        assert torch.equal(seen[bucket.index], covered), f"bucket {bucket.index}"
        writers = sum(bucket.index in rp.pieces for rp in rows)
        assert writers == rows[0].writers[bucket.index]


def _job(coordinator_factory, ranks: int, config: dict, receivers: int = 2):
    coord = coordinator_factory(config)
    rollouts = [rollout_actor(coord, MANIFEST, f"rollout-{i}", i, config) for i in range(receivers)]
    return coord, rollouts, sharded_trainers(coord, MANIFEST, ranks, config, receivers)


def _step(trainers, rollouts, version: int, gather: bool = False, late0: float = 0.0):
    """Version ``version`` on every rank; rank 0 begins ``late0`` seconds after the others."""
    applied = [r.apply.remote(version) for r in rollouts]
    ray.get([t.step.remote(version, gather, late0 if i == 0 else 0.0) for i, t in enumerate(trainers)], timeout=120)
    assert ray.get(applied, timeout=120) == [version] * len(rollouts)


WAYS = {"shm": {"transport": "shm"}, "relay": {"transport": "relay"},
        "broadcast": {"transport": "broadcast", "receive_ahead": "off"},
        "broadcast-ahead": {"transport": "broadcast", "receive_ahead": "on"}}


@pytest.mark.parametrize("way", list(WAYS))
def test_each_rank_writes_its_rows_and_receivers_load_them_bit_exact(coordinator_factory, way):
    """shm: into the host's segment; relay: to the first receiver, which relays whole buckets
    (the second receiver reads them from its host's segment); broadcast: over a group of its own
    to every receiver, at the barrier, or (receive_ahead) in every rank's stage(), into the
    receivers' ahead copies."""
    ranks = 3  # uneven: 1000, 10, 7 and 5 rows split 3 ways; 2 rows leave rank 2 none
    coord, rollouts, trainers = _job(coordinator_factory, ranks, {**CFG, **WAYS[way]})
    try:
        for v in (1, 2):
            _step(trainers, rollouts, v, late0=1.0 if v == 2 else 0.0)  # v2: the other ranks are there first
            for r in rollouts:
                assert_serves(r, MANIFEST, v)
            if way.startswith("broadcast"):  # v2 sent before the barrier (the ahead threads are up), or at it
                m = coord.metrics(v)
                assert [m.info.get("ahead", False), *(r.received_ahead for r in m.receivers.values())] == \
                    [way == "broadcast-ahead" and v == 2] * 3, m
            if way == "broadcast-ahead" and v == 1:
                wait_until("the receivers' ahead threads came up",
                           lambda: all(p.ahead for p in coord.status().parties if p.role == "receiver"), timeout=30)
        assert ray.get([t.sharded.remote() for t in trainers]) == [True] * ranks
        # each rank wrote exactly its own rows, two versions of them
        manifest = sharded(ranks)
        own = [sum((b[r + 1] - b[r]) * row_bytes(s) for s, b in zip(manifest.specs, manifest.rows))
               for r in range(ranks)]
        assert ray.get([t.written.remote() for t in trainers]) == [2 * n for n in own]
    finally:
        stop_actors([*trainers, *rollouts])


@pytest.mark.scenario("fault", "trainer rank killed mid-version (FSDP2 shards)", promise={
    "shm": "each rank writes its rows: the version aborts naming the rank, receivers keep the last version",
    "relay": "each rank sends its rows to the first receiver: the version aborts naming the rank, receivers keep "
             "the last version",
    "broadcast": "each rank broadcasts its rows over a group of its own: the version aborts naming the rank, "
                 "receivers keep the last version",
    "ipc": "the shards are gathered at the barrier: the version aborts naming the rank, no receiver hangs"})
@pytest.mark.parametrize("transport", ["shm", "relay", "broadcast", "ipc"])
def test_a_rank_killed_mid_version_aborts_it_named(coordinator_factory, transport):
    config = {**CFG, "transport": transport, "backend": "gloo"}
    coord, rollouts, trainers = _job(coordinator_factory, 3, config)
    try:
        _step(trainers, rollouts, 1)
        for r in rollouts:
            assert_serves(r, MANIFEST, 1)
        # shm, relay and broadcast take each rank's rows; ipc takes the gathered shards from rank 0
        takes_rows = transport != "ipc"
        assert ray.get([t.sharded.remote() for t in trainers]) == [takes_rows] * 3
        gathered = f"the FSDP2 shards are gathered (transport {transport} takes no rows; shm, relay and broadcast do)"
        assert (gathered in coord.status().transport_reason) == (not takes_rows)
        ray.get(trainers[2].hold_at.remote(3))
        steps = [t.step.remote(2) for t in trainers]
        applying = [r.apply.remote(2) for r in rollouts]
        assert ray.get(trainers[2].reached.remote(30))
        ray.kill(trainers[2])
        with pytest.raises((VersionError, WeightSyncError), match="trainer-2"):
            ray.get(steps[0], timeout=60)
        for r in applying:
            with pytest.raises(Exception, match="trainer-2"):
                ray.get(r, timeout=60)
        for r in rollouts:
            assert_serves(r, MANIFEST, 1)
        ray.wait([steps[1]], timeout=60)  # rank 1 is done with the aborted version too
    finally:
        stop_actors([*trainers, *rollouts])


@pytest.mark.scenario("fault", "a trainer rank's rows corrupted on their way (FSDP2 shards)", promise={
    "relay": "the head checks each rank's rows against that rank's digest: the version aborts naming the rank's rows, "
             "receivers keep the last version",
    "broadcast": "every receiver checks each rank's rows against that rank's digest: the version aborts naming the "
                 "rank's rows, receivers keep the last version"})
@pytest.mark.parametrize("transport", ["relay", "broadcast"])
def test_rows_that_arrive_changed_abort_the_version_naming_the_rank(coordinator_factory, transport):
    config = {**CFG, "transport": transport, "backend": "gloo"}
    coord, rollouts, trainers = _job(coordinator_factory, 3, config)
    try:
        _step(trainers, rollouts, 1)
        ray.get(trainers[2].corrupt_rows_digests.remote())
        applying = [r.apply.remote(2) for r in rollouts]
        steps = [t.step.remote(2) for t in trainers]
        with pytest.raises((VersionError, WeightSyncError), match="trainer rank 2's rows arrived with"):
            ray.get(steps[0], timeout=60)
        ray.wait(applying + steps[1:], num_returns=len(applying) + 2, timeout=60)
        for r in rollouts:
            assert_serves(r, MANIFEST, 1)
    finally:
        stop_actors([*trainers, *rollouts])


def _slots():
    """The shm slots of a 2-rank sharded session, as one process sees them: the tests below play
    each rank by setting ``slots.current`` to the version that rank writes."""
    from weightsync.config import SyncConfig
    from weightsync.transports import TransportContext
    from weightsync.transports.shm.transport import Slots

    manifest = sharded(2)
    ctx = TransportContext(config=SyncConfig(), plan=plan_buckets(manifest, 4096, 256), manifest=manifest,
                           digest=manifest.digest(), session="s", name="trainer-0", rank=0, device=torch.device("cpu"))
    return Slots(ctx)


def test_a_rank_still_writing_an_aborted_version_neither_counts_nor_completes_a_newer_one():
    """Version 5 is given up while rank 1 still writes it; version 6 takes the same slot. Rank 1's
    late count of bucket 0 must not make version 6's bucket complete before both its writers are
    done, and once version 6 counted there, rank 1's count for 5 is refused."""
    slots = _slots()
    try:
        slots.open(5, 0)
        assert slots.last_writer(0, 2) is False  # rank 0 wrote bucket 0 of version 5
        seg = slots.current[1]
        slots.open(6, 0)  # version 5 was aborted; 6 takes the slot
        stale = (5, seg)
        slots.current = stale
        assert slots.last_writer(0, 2) is True  # rank 1's late count completes only version 5's count
        slots.current = (6, seg)
        assert slots.last_writer(0, 2) is False  # version 6 counts afresh: one of its two writers
        slots.current = stale
        with pytest.raises(ProtocolError, match="version 6 took the slot"):
            slots.last_writer(0, 2)
        slots.current = (6, seg)
        assert slots.last_writer(0, 2) is True
    finally:
        slots.close()


def test_a_rank_that_finished_an_aborted_version_late_cannot_publish_over_the_newer_one():
    """Rank 1 was the last writer of bucket 0 of version 5 and is still digesting it when 5 is
    given up and version 6, taking the same slot, publishes bucket 0: rank 1's publish is refused
    and bucket 0's ready and digest words stay version 6's."""
    from weightsync.transports.shm.transport import _ready_word

    slots = _slots()
    try:
        slots.open(5, 0)
        assert slots.last_writer(0, 2) is False
        seg = slots.current[1]
        assert slots.last_writer(0, 2) is True  # rank 1: the last of version 5's writers, digesting
        slots.open(6, 0)  # version 5 aborted; 6 takes the slot, both its writers done, it publishes
        assert (slots.last_writer(0, 2), slots.last_writer(0, 2)) == (False, True)
        slots.publish_last(0, 2, 0x66)
        slots.current = (5, seg)
        with pytest.raises(ProtocolError, match="version 6 took the slot"):
            slots.publish_last(0, 2, 0x55)
        assert (int(seg.header[_ready_word(0)]), int(seg.header[_ready_word(0) + 1])) == (7, 0x66)
    finally:
        slots.close()
