"""weightsync as verl's checkpoint-engine backend, driven by verl's own CheckpointEngineManager
with real worker groups: the registry finds the backend through ``custom_backend_module`` in
the driver and in every worker, and a transfer reaches verl's CheckpointEngineWorker bit-exactly."""

from __future__ import annotations

import pytest

pytest.importorskip("verl")
pytestmark = pytest.mark.verl

MODULE = "weightsync_verl.checkpoint_engine"


def _config(transport, delta="off"):
    from verl.workers.config import CheckpointEngineConfig

    return CheckpointEngineConfig(
        backend="weightsync", custom_backend_module=MODULE, update_weights_bucket_megabytes=1,
        engine_kwargs={"weightsync": {"transport": transport, "coordinator_name": f"ws-verl-ce-{transport}-{delta}",
                                      "delta": delta,
                                      "bucket_mb": 1 / 64, "heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 5.0,
                                      "sync_timeout_s": 60.0, "connect_timeout_s": 60.0}})


@pytest.fixture(scope="module")
def worker_groups(ray_cluster):
    """2 actor workers, 2 rollout workers (verl's CheckpointEngineWorker); shared by the
    transports (each test builds fresh engines in them), since starting verl workers is slow."""
    from verl.workers.config import RolloutConfig
    from weightsync_verl.testing import CpuGroups, EngineActor, engine_rollout_worker

    made = CpuGroups()
    cfg = _config("shm")
    actors = made(EngineActor, 2, checkpoint_engine_config=cfg)
    rollouts = made(engine_rollout_worker(), 2, rollout_config=RolloutConfig(name="vllm", checkpoint_engine=cfg))
    yield actors, rollouts
    made.close()


def test_registry_finds_backend_by_custom_module():
    from verl.checkpoint_engine.base import CheckpointEngineRegistry
    from verl.utils.import_utils import import_external_libs

    import_external_libs(MODULE)
    cls = CheckpointEngineRegistry.get("weightsync")
    assert cls.__module__ == MODULE
    engine = CheckpointEngineRegistry.new("weightsync", bucket_size=3 << 20, transport="shm", checksum=False)
    assert engine.config.bucket_mb == 3.0 and engine.config.transport == "shm" and not engine.config.checksum
    assert engine.prepare() is None  # only the master starts a session
    assert CheckpointEngineRegistry.new("weightsync", bucket_size=1 << 20, delta="auto").config.delta == "auto"


def _transports():
    from weightsync import transports

    return [pytest.param(t, d, marks=pytest.mark.skipif(t not in transports.names(), reason=f"no {t} transport yet"))
            for t, d in (("shm", "off"), ("broadcast", "off"), ("broadcast", "on"))]


@pytest.mark.parametrize("transport, delta", _transports())
def test_manager_transfer_is_bit_exact(worker_groups, transport, delta):
    """Three steps through verl's manager, bit-exact. ``delta: on`` reaches our engine through
    verl's engine_kwargs: the first step moves the whole version, the next two (about 2 % of
    the bytes changed, as an RL step changes a few percent of the elements) under a quarter of
    it, the sparse buckets rebuilt in every rollout worker's shadow."""
    import ray
    from support.parties import assert_same_weights
    from verl.checkpoint_engine import CheckpointEngineManager
    from weightsync_verl.testing import ReplicaGates, hf_weights

    actors, rollouts = worker_groups
    cfg = _config(transport, delta)
    actors.use_engine(cfg)
    rollouts.use_engine(cfg)
    replicas = [ReplicaGates(rollouts.workers[:1]), ReplicaGates(rollouts.workers[1:])]
    manager = CheckpointEngineManager(config=cfg, actor_wg=actors, replicas=replicas)
    try:
        for step in (1, 2, 3):
            metrics = manager.update_weights(global_steps=step)
            assert metrics["weightsync/version"] == step and metrics["weightsync/gbps"] > 0
            expected = hf_weights(step)
            payload = sum(t.numel() * t.element_size() for t in expected.values())
            sparse = delta == "on" and step > 1
            moved = metrics["weightsync/wire_bytes"]
            assert (moved < payload / 4) if sparse else (moved >= payload), (step, moved, payload)
            for got in rollouts.received(step):
                assert list(got) == list(expected)  # verl's consumer sees the trainer's order and names
                assert_same_weights(got, expected, f"step {step}")
        # both actor ranks walked the generator every time (lockstep), only rank 0 sent
        assert actors.iterated_count() == [3 * len(expected)] * 2
        assert replicas[0].calls[:2] == ["abort", "release"]
    finally:
        ray.get(actors.execute_checkpoint_engine(["close"] * 2) + rollouts.execute_checkpoint_engine(["close"] * 2))


def _stage_ahead(actors, step):
    """What weightsync_verl.stage_ahead does right after update_actor: arm every actor rank, then
    their update_weights for the next step."""
    import ray

    ray.get(actors.execute_checkpoint_engine(["arm_ahead"] * 2))
    return ray.get(actors.update_weights(global_steps=step))


def _settle(actors):
    """What it does before the next sync: every rank's view, then one verdict for all."""
    import ray

    keep = all(ray.get(actors.execute_checkpoint_engine(["ahead_usable"] * 2)))
    ray.get(actors.execute_checkpoint_engine(["keep_ahead"] * 2, [keep] * 2))
    return keep


@pytest.mark.parametrize("transport, ahead, kept", [("shm", "off", True), ("broadcast", "off", False)])
def test_a_version_staged_ahead_is_synced_without_a_second_walk(worker_groups, transport, ahead, kept):
    """A version staged right after the update is the one the next sync commits, and no rank
    walks its parameters again; where stage() moves no bytes (broadcast without receive_ahead)
    it is withdrawn on every rank alike, and the sync stages the next integer afresh, walked by
    every rank once more. Either way the rollouts end with that step's weights, bit for bit."""
    import ray
    from support.parties import assert_same_weights
    from verl.checkpoint_engine import CheckpointEngineManager
    from weightsync_verl.testing import ReplicaGates, hf_weights

    actors, rollouts = worker_groups
    cfg = _config(transport)
    cfg.engine_kwargs["weightsync"]["receive_ahead"] = ahead
    actors.use_engine(cfg)
    rollouts.use_engine(cfg)
    manager = CheckpointEngineManager(config=cfg, actor_wg=actors,
                                      replicas=[ReplicaGates(rollouts.workers[:1]), ReplicaGates(rollouts.workers[1:])])
    try:
        manager.update_weights(global_steps=1)
        staged = _stage_ahead(actors, 2)
        walked = actors.iterated_count()
        assert _settle(actors) is kept and staged[0]["weightsync/staged_ahead"] == float(kept)
        metrics = manager.update_weights(global_steps=2)
        expected = hf_weights(2)
        again = [n - w for n, w in zip(actors.iterated_count(), walked)]
        outcome = (metrics["weightsync/version"], again)
        assert outcome == ((2, [0, 0]) if kept else (3, [len(expected)] * 2)), outcome
        for got in rollouts.received(2):
            assert_same_weights(got, expected, "step 2")
    finally:
        ray.get(actors.execute_checkpoint_engine(["close"] * 2) + rollouts.execute_checkpoint_engine(["close"] * 2))
