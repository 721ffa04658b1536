"""Every trainer rank sends its own rows (a sharded session): FSDP2 shards (DTensors, Shard(0)) on
real gloo ranks, uneven splits included, written by each rank into the host's segment (shm) or sent
over its own pairs / group (relay, broadcast); the receivers load whole tensors, bit-exact. Where a
transport takes no rows the shards are gathered, as full_tensor() did before. Faults:
test_shards_faults.py."""

from __future__ import annotations

import pytest
import ray
import torch

from support.parties import assert_serves, rollout_actor, stop_actors, wait_until
from support.shards import MANIFEST, sharded, sharded_trainers
from weightsync.errors import ProtocolError
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
    trainers = sharded_trainers(coord, MANIFEST, ranks, config, receivers)
    ray.get([r.pid.remote() for r in rollouts], timeout=300)  # up, as the trainers are: no version times their start
    return coord, rollouts, trainers


def _step(trainers, rollouts, version: int, gather: bool = False, late0: float = 0.0):
    """Version ``version`` on every rank; rank 0 begins ``late0`` seconds after the others."""
    applied = [r.apply.remote(version) for r in rollouts]
    ray.get([t.step.remote(version, gather, late0 if i == 0 else 0.0) for i, t in enumerate(trainers)], timeout=120)
    assert ray.get(applied, timeout=120) == [version] * len(rollouts)


WAYS = {"shm": {"transport": "shm"}, "relay": {"transport": "relay"},
        # v1 goes at the barrier (no receiver's ahead thread is up yet), v2 ahead: both ways in one job
        "broadcast": {"transport": "broadcast", "receive_ahead": "on"}}


@pytest.mark.parametrize("way", list(WAYS))
def test_each_rank_writes_its_rows_and_receivers_load_them_bit_exact(coordinator_factory, way):
    """shm: into the host's segment; relay: to the first receiver, which relays whole buckets
    (the second receiver reads them from its host's segment); broadcast: over a group of its own
    to every receiver, at the barrier (v1), then with receive_ahead in every rank's stage(), into
    the receivers' ahead copies (v2)."""
    ranks = 3  # uneven: 1000, 10, 7 and 5 rows split 3 ways; 2 rows leave rank 2 none
    coord, rollouts, trainers = _job(coordinator_factory, ranks, {**CFG, **WAYS[way]})
    try:
        for v in (1, 2):
            _step(trainers, rollouts, v, late0=1.0 if v == 2 else 0.0)  # v2: the other ranks are there first
            for r in rollouts:
                assert_serves(r, MANIFEST, v)
            if way == "broadcast":  # v1 at the barrier, v2 before it (the ahead threads are up)
                m = coord.metrics(v)
                assert [m.info.get("ahead", False), *(r.received_ahead for r in m.receivers.values())] == \
                    [v == 2] * 3, m
            if way == "broadcast" and v == 1:
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
