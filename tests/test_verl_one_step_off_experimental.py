"""verl >= 0.8's own one-step-off trainer (``verl.experimental.one_step_off_policy``, verl 0.9.1
installed) syncing through weightsync with the README's command-line overrides.

Real verl: the Hydra config files (``one_step_off_ppo_trainer.yaml`` over ``ppo_trainer``),
what ``main_ppo.main`` / ``OneStepTaskRunner.run`` do to the config before the trainer exists,
``OneStepOffRayTrainer.init_workers`` (which builds the ``CheckpointEngineManager`` from
``omega_conf_to_dataclass(config.actor_rollout_ref.rollout.checkpoint_engine)``), the trainer's
``_init_models`` and ``_fit_update_weights``, the manager, ``CheckpointEngineWorker`` (the
rollout side, built from the ``RolloutConfig`` a ``RolloutReplica`` derives from the same config)
and Ray worker groups. Stand-ins, because no GPU, model or vLLM server runs here: the trainer's
resource pools / worker groups / reward loop / LLM server set-up (CPU worker groups instead),
the actor's model (``EngineActor``: verl's actor-worker methods over fixed weights), the vLLM
server adapter (``Collector``) and the replicas' request gates (``ReplicaGates``).
"""

from __future__ import annotations

import asyncio
import os
from types import SimpleNamespace

import pytest

pytest.importorskip("verl")
pytestmark = pytest.mark.verl

README_OVERRIDES = [  # the README's verl >= 0.8 lines, verbatim but for the transport value
    "actor_rollout_ref.rollout.checkpoint_engine.backend=weightsync",
    "actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=weightsync_verl.checkpoint_engine",
    "+actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.weightsync.transport={transport}",
]
USER_OVERRIDES = [  # from the user's command, sized to 2 actor ranks and 2 one-worker replicas on CPU
    "algorithm.adv_estimator=grpo", "actor_rollout_ref.hybrid_engine=False", "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.rollout.mode=async", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    "trainer.device=cpu", "trainer.n_gpus_per_node=2", "rollout.n_gpus_per_node=2",
]
TEST_KWARGS = {  # short deadlines and small buckets keep a CI run lean
    "coordinator_name": "ws-verl-1off-{transport}", "bucket_mb": 1 / 64, "heartbeat_interval_s": 0.2,
    "heartbeat_timeout_s": 5.0, "sync_timeout_s": 60.0, "connect_timeout_s": 60.0,
}


def compose_config(transport: str, monkeypatch: pytest.MonkeyPatch):
    """The config verl's one-step-off ``main_ppo`` runs with, composed as its ``@hydra.main`` does."""
    import verl
    import verl.experimental.one_step_off_policy as recipe
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf
    from verl.utils.device import auto_set_device

    # the yaml's searchpath is file://verl/trainer/config, relative to the working directory:
    # users launch it from verl's source root, here the directory holding the installed package
    monkeypatch.chdir(os.path.dirname(os.path.dirname(verl.__file__)))
    kwargs = [f"+actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.weightsync.{k}={v}"
              for k, v in TEST_KWARGS.items()]
    overrides = [o.format(transport=transport) for o in README_OVERRIDES + USER_OVERRIDES + kwargs]
    with initialize_config_dir(config_dir=os.path.join(os.path.dirname(recipe.__file__), "config"), version_base=None):
        config = compose("one_step_off_ppo_trainer", overrides=overrides)
    # main_ppo.main, then OneStepTaskRunner.run
    auto_set_device(config)
    config.actor_rollout_ref.rollout.nnodes = config.rollout.nnodes
    config.actor_rollout_ref.rollout.n_gpus_per_node = config.rollout.n_gpus_per_node
    OmegaConf.resolve(config)
    return config


def cpu_trainer(config, made):
    """verl's OneStepOffRayTrainer with only its hardware set-up replaced: its own __init__
    needs a tokenizer and datasets, and its pools, worker groups and LLM servers need GPUs."""
    from verl.checkpoint_engine.base import CheckpointEngineWorker
    from verl.experimental.one_step_off_policy.ray_trainer import OneStepOffRayTrainer
    from verl.trainer.ppo.utils import Role, need_critic, need_reference_policy, need_reward_model
    from verl.utils.config import omega_conf_to_dataclass
    from weightsync_verl.testing import Collector, EngineActor, ReplicaGates

    class CpuOneStepOffTrainer(OneStepOffRayTrainer):
        def __init__(self) -> None:  # the fields verl's __init__ sets that the weight path reads
            self.config = config
            self.hybrid_engine = config.actor_rollout_ref.hybrid_engine
            self.use_critic, self.use_rm = need_critic(config), need_reward_model(config)
            self.use_reference_policy, self.ref_in_actor = need_reference_policy(config), False
            self.global_steps, self.metrics, self.timing_raw = 0, {}, {}
            self.checkpoint_manager = None

        def _init_resource_pools(self) -> None:
            pass

        def _create_worker_classes(self) -> None:
            pass

        def _init_worker_groups(self) -> None:
            ce = omega_conf_to_dataclass(config.actor_rollout_ref.rollout.checkpoint_engine)
            self.all_wg = {str(Role.Actor): made(EngineActor, 2, checkpoint_engine_config=ce)}

        def _init_reward_loop(self) -> None:
            pass

        def _init_async_rollout_manager(self) -> None:
            # as RolloutReplica: RolloutConfig from the rollout section, CheckpointEngineWorker per rank
            rollout_config = omega_conf_to_dataclass(config.actor_rollout_ref.rollout)

            class Rollout(CheckpointEngineWorker):
                def __init__(self) -> None:
                    super().__init__(rollout_config, None, server_adapter=Collector())

                def received(self, global_steps):
                    return self.server_adapter.received.get(global_steps, {})

            wg = made(Rollout, 2)
            self.rollout_wg = wg
            replicas = [ReplicaGates(wg.workers[:1]), ReplicaGates(wg.workers[1:])]
            self.llm_server_manager = SimpleNamespace(get_replicas=lambda: replicas)

    return CpuOneStepOffTrainer()


# broadcast, the README's value; shm through the same manager is in test_verl_checkpoint_engine.py
# (each transport here costs ~20 s of verl worker start-up on a 2-core VM)
@pytest.mark.parametrize("transport", ["broadcast"])
def test_one_step_off_trainer_syncs_bit_exact(ray_cluster, monkeypatch, transport):
    """The trainer's initial sync (step 0, as fit() does) and two steps' syncs each leave the
    rollout workers with the actor's weights of that step, bit for bit, in the trainer's order."""
    import ray
    from support.parties import assert_same_weights
    from weightsync_verl.testing import CpuGroups, hf_weights

    config = compose_config(transport, monkeypatch)
    assert config.actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.weightsync.transport == transport
    made = CpuGroups()
    trainer = cpu_trainer(config, made)
    try:
        trainer.init_workers()

        async def steps():  # fit() is a coroutine: the trainer syncs with an event loop running
            received = {}
            for step in (0, 1, 2):
                trainer.global_steps = step
                trainer._fit_update_weights()
                assert trainer.metrics["weightsync/version"] == step
                received[step] = ray.get([w.received.remote(step) for w in trainer.rollout_wg.workers])
            return received

        for step, per_worker in asyncio.run(steps()).items():
            expected = hf_weights(step)
            for got in per_worker:
                assert list(got) == list(expected)
                assert_same_weights(got, expected, f"step {step}")
    finally:
        wgs = [trainer.all_wg[k] for k in getattr(trainer, "all_wg", {})] + [getattr(trainer, "rollout_wg", None)]
        refs = [r for wg in wgs if wg is not None for r in wg.execute_checkpoint_engine(["close"] * wg.world_size)]
        ray.get(refs)
        made.close()

