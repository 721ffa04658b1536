"""A trainer rank of a sharded session lost, or its rows changed on their way: the version aborts
naming the rank, on each transport, and the receivers keep what they served (test_shards.py runs
the same jobs when nothing fails)."""

from __future__ import annotations

import pytest
import ray
from test_shards import CFG, _job, _step

from support.parties import assert_serves, stop_actors
from support.shards import MANIFEST
from weightsync.errors import VersionError, WeightSyncError


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
    coord, rollouts, trainers = _job(coordinator_factory, 2, config)  # rank 1 is lost; 2 ranks show it, as 3 would
    try:
        _step(trainers, rollouts, 1)
        for r in rollouts:
            assert_serves(r, MANIFEST, 1)
        # shm, relay and broadcast take each rank's rows; ipc takes the gathered shards from rank 0
        takes_rows = transport != "ipc"
        assert ray.get([t.sharded.remote() for t in trainers]) == [takes_rows] * 2
        gathered = f"the FSDP2 shards are gathered (transport {transport} takes no rows; shm, relay and broadcast do)"
        assert (gathered in coord.status().transport_reason) == (not takes_rows)
        ray.get(trainers[1].hold_at.remote(3))
        steps = [t.step.remote(2) for t in trainers]
        applying = [r.apply.remote(2) for r in rollouts]
        assert ray.get(trainers[1].reached.remote(30))
        ray.kill(trainers[1])
        with pytest.raises((VersionError, WeightSyncError), match="trainer-1"):
            ray.get(steps[0], timeout=60)
        for r in applying:
            with pytest.raises(Exception, match="trainer-1"):
                ray.get(r, timeout=60)
        for r in rollouts:
            assert_serves(r, MANIFEST, 1)
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
    coord, rollouts, trainers = _job(coordinator_factory, 2, config)
    try:
        _step(trainers, rollouts, 1)
        ray.get(trainers[1].corrupt_rows_digests.remote())
        applying = [r.apply.remote(2) for r in rollouts]
        steps = [t.step.remote(2) for t in trainers]
        with pytest.raises((VersionError, WeightSyncError), match="trainer rank 1's rows arrived with"):
            ray.get(steps[0], timeout=60)
        ray.wait(applying + steps[1:], num_returns=len(applying) + 1, timeout=60)
        for r in rollouts:
            assert_serves(r, MANIFEST, 1)
    finally:
        stop_actors([*trainers, *rollouts])
