"""One-step-off-policy: the staleness bound, staging ahead of the barrier, and the CPU example
(a real REINFORCE loop on Ray actors) run in its quick size."""

from __future__ import annotations

import importlib.util
import statistics
import sys
from pathlib import Path

import pytest
import ray
import torch
from support.parties import assert_serves, rollout_actor
from weightsync_bench.timeline import Recorder, Span, busy_seconds, render_png

from weightsync import StalenessError, VersionError, WeightSender, build_manifest, check_staleness

ROOT = Path(__file__).resolve().parents[1]


def load_example():
    spec = importlib.util.spec_from_file_location("one_step_off_cpu", ROOT / "examples" / "one_step_off_cpu.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    # the example is not an installed module: ship its actor classes to the workers by value
    ray.cloudpickle.register_pickle_by_value(module)
    return module


# -- the staleness bound ---------------------------------------------------------------------

def test_staleness_bound_pure():
    assert check_staleness(5, 5, 1) == 0
    assert check_staleness(4, 5, 1) == 1
    with pytest.raises(StalenessError, match="2 versions old"):
        check_staleness(3, 5, 1)
    with pytest.raises(StalenessError, match="carries no weight version"):
        check_staleness(None, 5, 1)
    with pytest.raises(StalenessError, match="newer than the step"):
        check_staleness(6, 5, 1)


def test_coordinator_rejects_stale_batches(coordinator_factory):
    coord = coordinator_factory({"max_staleness": 1})
    assert coord.check_batch(4, 5) == 1
    with pytest.raises(StalenessError, match="max_staleness=1"):
        coord.check_batch(3, 5)
    assert coord.check_batch(3, 5, max_staleness=2) == 2  # a per-call bound overrides the config
    on_policy = coordinator_factory({"max_staleness": 0})
    with pytest.raises(StalenessError, match="max_staleness=0"):
        on_policy.check_batch(4, 5)


# -- staging ahead of the barrier --------------------------------------------------------------

def test_shm_barrier_moves_no_trainer_bytes(coordinator_factory, actors):
    """The trainer packs a version while receivers are still busy; sync() then only waits
    for receiver work: the sender's packed-byte counter does not move during the barrier."""
    manifest = build_manifest(materialize_toy(0))
    coord = coordinator_factory({"transport": "shm", "bucket_mb": 0.05})
    workers = [actors.add(rollout_actor(coord, manifest, f"rollout-{i}", rank=i)) for i in range(2)]
    sender = WeightSender(coord, expected_receivers=2)
    try:
        with pytest.raises(VersionError, match="never staged version 1"):
            sender.sync(1)
        payload = None
        for version in (1, 2):
            weights = materialize_toy(version)
            handle = sender.stage(version, weights, background=True)  # receivers are not applying yet
            handle.wait(timeout=60)
            assert handle.done()
            before = sender.transport.packed_bytes
            payload = payload or before
            assert before == version * payload == version * sum(b.nbytes for b in sender.plan.buckets)
            applied = [w.apply.remote(version) for w in workers]
            result = sender.sync(version)
            assert ray.get(applied) == [version, version]
            assert sender.transport.packed_bytes == before, "the barrier packed trainer-side bytes"
            assert result.metrics.info["packed_bytes"] == payload
            for w in workers:
                assert_serves(w, weights, version)
    finally:
        sender.close()


def materialize_toy(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"embed": torch.randn(64, 96, generator=gen), "mlp.weight": torch.randn(96, 200, generator=gen),
            "mlp.bias": torch.randn(200, generator=gen).to(torch.bfloat16), "head": torch.randn(200, 16, generator=gen)}


# -- the example, quick size ------------------------------------------------------------------

@pytest.fixture(scope="module")
def example():
    return load_example()


@pytest.mark.parametrize("mode", ["sync", "one-step-off"])
def test_example_learns_and_tags_every_batch(ray_cluster, example, mode):
    steps = 8
    result = example.run(mode, steps, example.QUICK_TASK, log=lambda line: None)
    assert [s["step"] for s in result["steps"]] == list(range(steps))
    digests = result["digests"]
    for s in result["steps"]:
        assert len(s["batches"]) == 2
        for b, lag in zip(s["batches"], s["lags"], strict=True):
            # the tag is the version the worker served: its weights are exactly the trainer's
            # weights of that version, bit for bit
            assert b["digest"] == digests[b["version"]], (s["step"], b)
            assert lag == s["step"] - b["version"]
            expected_lag = 0 if mode == "sync" or s["step"] == 0 else 1
            assert lag == expected_lag, (mode, s["step"], b)
        assert s["sync"]["served"] == [s["step"] + 1] * 2
        # shm: everything the trainer writes happens before the barrier
        assert s["sync"]["packed_after_barrier"] == s["sync"]["packed_before_barrier"]
    rewards = [s["reward"] for s in result["steps"]]
    first, last = statistics.mean(rewards[:3]), statistics.mean(rewards[-3:])
    assert last > first + 0.03, rewards
    # the timeline has every actor and phase, with sane spans
    spans = result["spans"]
    assert {s.actor for s in spans} == {"trainer", "rollout-0", "rollout-1"}
    assert {s.phase for s in spans} == {"train", "stage", "barrier", "generate", "apply"}
    assert all(s.end >= s.start for s in spans)
    assert len([s for s in spans if s.actor == "trainer" and s.phase == "train"]) == steps


def test_example_enforces_the_staleness_bound(ray_cluster, example):
    # one-step-off trains step 1 on a batch made with version 0: over a bound of 0
    with pytest.raises(StalenessError, match="max_staleness=0"):
        example.run("one-step-off", 2, example.QUICK_TASK, max_staleness=0, log=lambda line: None)


def test_timeline_renders(tmp_path):
    pytest.importorskip("matplotlib")
    rec = Recorder("trainer")
    rec.add("train", 0.0, 1.0)
    rec.add("stage", 1.0, 1.1)
    rec.add("generate", 0.0, 0.9, actor="rollout-0")
    spans = [Span.from_wire(row) for row in rec.drain()]
    assert rec.spans == [] and busy_seconds(spans, "trainer") == pytest.approx(1.1)
    path = tmp_path / "t.png"
    assert render_png([("demo", spans, [1.1])], str(path)) is None
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
