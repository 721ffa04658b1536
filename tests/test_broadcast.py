"""Broadcast transport: real Ray actors, a real gloo group built from our own store.

The device tests run the same flow over NCCL / HCCL; on a node with two or more devices:
    python -m pytest tests/test_broadcast.py -m cuda     # CUDA, backend nccl
    python -m pytest tests/test_broadcast.py -m npu      # Ascend, backend hccl
"""

from __future__ import annotations

import sys
import time
from types import SimpleNamespace

import pytest
import ray
import torch

from weightsync import SyncFailed
from weightsync.device import ray_options
from weightsync.errors import ConfigError
from weightsync.layouts import layout, materialize
from weightsync.manifest import Manifest, TensorSpec
from weightsync.testing import RolloutWorker, TrainerWorker, same_bits
from weightsync.transports.broadcast import (
    TRAILER,
    choose_backend,
    comm_device,
    get_checksum,
    put_checksum,
)

TINY = layout("tiny")  # embed_tokens is 125 KiB: several buckets of the size below
BUCKET_MB = 48 / 1024
CFG = {"transport": "broadcast", "bucket_mb": BUCKET_MB, "sync_timeout_s": 30.0, "device": "cpu"}
# 56 MiB in 4 MiB buckets: far more than the socket buffers hold, so the sender cannot run
# ahead of a slow receiver and a kill lands in the middle of the transfer
WIDE = Manifest((TensorSpec("embed", "bfloat16", (2048, 6144)),
                 *(TensorSpec(f"layers.{i}.w", "bfloat16", (1024, 2048)) for i in range(8))))
WIDE_CFG = {"transport": "broadcast", "bucket_mb": 4.0, "sync_timeout_s": 20.0, "device": "cpu"}


class SlowRollout(RolloutWorker):
    """A rollout worker whose engine takes ``delay`` seconds per load_weights call, so a
    transfer lasts long enough to kill or stall a party in the middle of it."""

    def __init__(self, *args, delay: float = 0.0, **kwargs):
        super().__init__(*args, **kwargs)
        load = self.engine.load_weights

        def slow(weights):
            time.sleep(delay)
            return load(weights)

        self.receiver.load_weights = slow


# Ray workers cannot import this test module: ship SlowRollout to them by value
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _rollouts(actors, coord, names, config, delay=0.0, manifest=TINY):
    cls = ray.remote(SlowRollout).options(num_cpus=0)
    return [actors.add(cls.remote(coord, manifest.to_wire(), name, rank=rank, config=config, delay=delay))
            for rank, name in names]


def _check_weights(rollout, version, manifest=TINY):
    want = materialize(manifest, seed=version)
    got = ray.get(rollout.weights.remote())
    bad = [n for n in want if not same_bits(got[n], want[n])]
    assert not bad, f"version {version}: {len(bad)} tensors differ, first {bad[:3]}"


def test_plan_has_a_tensor_larger_than_a_bucket():
    from weightsync.config import SyncConfig
    from weightsync.plan import plan_buckets

    plan = plan_buckets(TINY, SyncConfig(bucket_mb=BUCKET_MB).bucket_bytes)
    assert max(len(s) for s in plan.tensor_slices) >= 3
    assert plan.bucket_count >= 6


def test_backend_follows_device_and_refuses_a_mismatch():
    assert choose_backend("auto", torch.device("cpu")) == "gloo"
    assert choose_backend("auto", torch.device("cuda", 0)) == "nccl"
    npu = SimpleNamespace(type="npu", index=0)  # torch without torch_npu cannot name the device
    assert choose_backend("auto", npu) == "hccl"
    assert choose_backend("gloo", torch.device("cuda", 0)) == "gloo"
    assert comm_device("gloo", npu, "x") == torch.device("cpu")
    with pytest.raises(ConfigError, match="backend 'hccl' needs npu devices, but receiver 'r' runs on cpu"):
        comm_device("hccl", torch.device("cpu"), "receiver 'r'")


def test_checksum_trailer_round_trip():
    buf = torch.randint(0, 256, (1000 + TRAILER,), dtype=torch.uint8)
    value = put_checksum(buf, 1000)
    assert get_checksum(buf, 1000) == value
    buf[3] ^= 1
    assert put_checksum(buf, 1000) != value


def test_ten_versions_bit_exact_one_group(coordinator_factory, actors):
    """1 sender + 3 receivers + a non-sending trainer rank, 10 versions, bit-exact; the
    group is built once (epoch 1) and reused by every version."""
    coord = coordinator_factory(CFG)
    rollouts = _rollouts(actors, coord, [(r, f"rollout-{r}") for r in range(3)], CFG)
    trainer_cls = ray.remote(TrainerWorker).options(num_cpus=0)
    sender = actors.add(trainer_cls.remote(coord, TINY.to_wire(), rank=0, config=CFG, expected_receivers=3))
    follower = actors.add(trainer_cls.remote(coord, TINY.to_wire(), rank=1, config=CFG))
    for v in range(1, 11):
        applied = [r.apply.remote(v) for r in rollouts]
        ray.get(sender.stage.remote(v), timeout=60)  # rank 1's sync needs the version to exist
        other = follower.step.remote(v)
        out = ray.get(sender.sync.remote(v), timeout=60)
        assert ray.get(applied, timeout=60) == [v, v, v]
        assert ray.get(other, timeout=60)["version"] == v
        assert out["metrics"]["state"] == "COMMITTED"
        assert out["metrics"]["info"]["group"] == {"epoch": 1, "members": ["rollout-0", "rollout-1", "rollout-2"]}
        for r in rollouts:
            _check_weights(r, v)
    counters = ray.get([r.counters.remote() for r in rollouts])
    assert [c["post_loads"] for c in counters] == [10, 10, 10]
    status = coord.status()
    assert status["transport"] == "broadcast"
    assert status["group"] == {"backend": "gloo", "communicator": "torch",
                               "communicator_reason": "gloo: torch ProcessGroupGloo, its only construction"}
    assert status["resources"]["bcast_groups"] == 4  # one group per party, never rebuilt


@pytest.mark.scenario("fault", "receiver killed mid-transfer (broadcast)")
def test_receiver_killed_mid_transfer(coordinator_factory, actors):
    """Kill one of three receivers while a version is on the wire: every side gets an error
    naming it within the deadline; no survivor serves torn weights; the survivors and a
    restarted receiver converge on the next version over a re-formed group."""
    cfg = WIDE_CFG
    coord = coordinator_factory(cfg)
    names = [(r, f"rollout-{r}") for r in range(3)]
    rollouts = _rollouts(actors, coord, names, cfg, delay=0.1, manifest=WIDE)
    sender = actors.add(ray.remote(TrainerWorker).options(num_cpus=0).remote(
        coord, WIDE.to_wire(), config=cfg, expected_receivers=3))
    applied = [r.apply.remote(1) for r in rollouts]
    ray.get(sender.step.remote(1), timeout=60)
    assert ray.get(applied, timeout=60) == [1, 1, 1]

    applied = [r.apply.remote(2) for r in rollouts]
    ray.get(sender.stage.remote(2), timeout=60)
    outcome = sender.sync.remote(2)
    time.sleep(0.5)  # a few of the 14 buckets in: each load takes 0.1 s
    t0 = time.monotonic()
    ray.kill(rollouts[2])
    with pytest.raises(SyncFailed) as failed:
        ray.get(outcome, timeout=60)
    assert "rollout-2" in str(failed.value)
    for r, ref in zip(rollouts[:2], applied[:2], strict=True):
        try:
            served = ray.get(ref, timeout=60)
        except ray.exceptions.RayTaskError as exc:
            assert "rollout-2" in str(exc)  # the error names the party at fault
            served = ray.get(r.version.remote())
        assert served in (None, 2)  # never a mix: serves 2 only if all of it arrived
        if served == 2:
            _check_weights(r, 2, WIDE)
    assert time.monotonic() - t0 < cfg["sync_timeout_s"]

    restarted = _rollouts(actors, coord, [names[2]], cfg, manifest=WIDE)[0]
    assert ray.get(restarted.version.remote(), timeout=60) is None  # registered: part of the next barrier
    rollouts = rollouts[:2] + [restarted]
    applied = [r.apply.remote(3) for r in rollouts]
    out = ray.get(sender.step.remote(3), timeout=60)
    assert ray.get(applied, timeout=60) == [3, 3, 3]
    assert out["metrics"]["info"]["group"]["epoch"] == 2
    for r in rollouts:
        _check_weights(r, 3, WIDE)


@pytest.mark.scenario("fault", "receiver stalled past the deadline (broadcast)")
def test_stalled_receiver_is_named_and_rejoins(coordinator_factory, actors):
    """A receiver alive but stuck in load_weights past the version's deadline: the sender's
    sync fails within the deadline (plus the coordinator's slack) naming it; receivers that
    got every bucket commit, ones held up behind it in the broadcast tree fail cleanly; once
    it recovers, the next version includes everyone again."""
    cfg = {**CFG, "sync_timeout_s": 3.0}
    coord = coordinator_factory(cfg)
    fast = _rollouts(actors, coord, [(0, "rollout-0"), (1, "rollout-1")], cfg)
    stuck = _rollouts(actors, coord, [(2, "rollout-2")], cfg, delay=0.6)[0]
    sender = actors.add(ray.remote(TrainerWorker).options(num_cpus=0).remote(
        coord, TINY.to_wire(), config=cfg, expected_receivers=3))
    applied = [r.apply.remote(1) for r in fast + [stuck]]
    ray.get(sender.stage.remote(1), timeout=60)
    t0 = time.monotonic()
    with pytest.raises(SyncFailed) as failed:
        ray.get(sender.sync.remote(1), timeout=60)
    assert time.monotonic() - t0 < cfg["sync_timeout_s"] + 3.0
    assert "rollout-2" in failed.value.failed
    for r, ref in zip(fast, applied[:2], strict=True):
        try:
            served = ray.get(ref, timeout=60)
        except ray.exceptions.RayTaskError:
            served = ray.get(r.version.remote())
        assert served in (None, 1)
        if served == 1:
            _check_weights(r, 1)
    with pytest.raises(ray.exceptions.RayTaskError, match="rollout-2"):
        ray.get(applied[2], timeout=60)  # its own deadline passed in the middle of the version
    assert ray.get(stuck.version.remote()) is None

    # the next version, with a deadline the slow engine fits in, includes it again
    applied = [r.apply.remote(2, timeout=30.0) for r in fast + [stuck]]
    ray.get(sender.stage.remote(2), timeout=60)
    out = ray.get(sender.sync.remote(2, timeout=30.0), timeout=60)
    assert ray.get(applied, timeout=60) == [2, 2, 2]
    assert out["metrics"]["info"]["group"]["epoch"] == 2
    for r in fast + [stuck]:
        _check_weights(r, 2)


def _device_flow(coordinator_factory, actors, kind: str, resources: dict):
    count = torch.cuda.device_count() if kind == "cuda" else torch.npu.device_count()
    if count < 2:
        pytest.skip(f"needs two {kind} devices (a communicator cannot hold one device twice)")
    cfg = {**CFG, "device": kind, "bucket_mb": 1.0}
    coord = coordinator_factory(cfg)
    opts = {"num_cpus": 0, **resources}
    rollout = actors.add(ray.remote(RolloutWorker).options(**opts).remote(coord, TINY.to_wire(), "rollout-0",
                                                                         config=cfg))
    sender = actors.add(ray.remote(TrainerWorker).options(**opts).remote(coord, TINY.to_wire(), config=cfg,
                                                                        expected_receivers=1))
    for v in range(1, 4):
        applied = rollout.apply.remote(v)
        ray.get(sender.step.remote(v), timeout=120)
        assert ray.get(applied, timeout=120) == v
        want = materialize(TINY, seed=v)
        got = ray.get(rollout.weights.remote())
        assert all(same_bits(got[n].cpu(), want[n]) for n in want)
    assert coord.status()["versions"][-1]["info"]["backend"] == ("nccl" if kind == "cuda" else "hccl")


@pytest.mark.cuda
def test_nccl_bit_exact(coordinator_factory, actors):
    _device_flow(coordinator_factory, actors, "cuda", ray_options("cuda", 1))


@pytest.mark.npu
def test_hccl_bit_exact(coordinator_factory, actors):
    _device_flow(coordinator_factory, actors, "npu", ray_options("npu", 1))
