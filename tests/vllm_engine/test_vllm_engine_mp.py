"""The weightsync backend where vLLM runs its worker outside the caller's process: the
offline ``LLM`` with multiprocessing on (vLLM's default; VLLM_ENABLE_V1_MULTIPROCESSING=1),
inside a Ray actor. vLLM spawns its engine core, and the worker in it, as a plain
subprocess, no Ray job: the engine joins the trainer's Ray cluster at the address and
namespace the trainer put in the init info, and reaches the coordinator by name there."""

from __future__ import annotations

import os
import sys

import pytest
import ray
import wt_parties as P

BOUND = 1e-4
CHANGED = 1e-2
ray.cloudpickle.register_pickle_by_value(P)
ray.cloudpickle.register_pickle_by_value(P.E)
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def sides_mp(ray_cluster):
    hf = {**P.E.QWEN2, "tie_word_embeddings": False}
    threads = {"env_vars": {"OMP_NUM_THREADS": str(max(2, os.cpu_count() or 2))}}
    rollout = ray.remote(P.VllmRollout).options(num_cpus=0, runtime_env=threads).remote(hf, multiprocessing=True)
    trainer = ray.remote(P.Trainer).options(num_cpus=0).remote(hf)
    try:
        ray.get(rollout.generate.remote(0), timeout=900)
        yield rollout, trainer
    finally:
        try:
            ray.get(trainer.close.remote(), timeout=30)
        except Exception:  # a failed test may have left it unusable; it is killed all the same
            pass
        try:
            ray.get(rollout.shutdown.remote(), timeout=120)  # vLLM stops its engine core subprocess
        except Exception:
            pass
        for actor in (trainer, rollout):
            ray.kill(actor)


def test_a_worker_in_vllms_subprocess_joins_the_trainers_ray_job(coordinator_factory, sides_mp):
    rollout, trainer = sides_mp
    assert ray.get(rollout.engine_core_client.remote()) == "SyncMPClient"
    coord = coordinator_factory({"bucket_mb": 0.25, "transport": "shm", "sync_timeout_s": 120.0,
                                 "connect_timeout_s": 120.0})
    ray.get(trainer.connect.remote(rollout, coord.name, coord.token, coord.config.to_dict(), 1), timeout=300)
    ray.get(rollout.generate.remote(100))
    for v in (1, 2):
        err = ray.get(trainer.step.remote(v), timeout=300)
        assert err == "", err
        assert ray.get(rollout.weight_version.remote()) == str(v)
        cur, old = ray.get(trainer.diffs.remote(ray.get(rollout.generate.remote(v))))
        assert cur <= BOUND and old > CHANGED, (v, cur, old)
