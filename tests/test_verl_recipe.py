"""The one-step-off recipe adapter, driven the way the recipe's fit() drives it: real verl
worker groups with @register dispatch, FSDP-style actor ranks whose full_tensor() is a real
gloo collective, and a rollout model with vLLM's fused qkv_proj / gate_up_proj loading."""

from __future__ import annotations

import asyncio
import sys
import textwrap

import pytest

pytest.importorskip("verl")
pytestmark = pytest.mark.verl


class StandInTrainer:
    """What OneStepOffRayTrainer (verl v0.5.0-716-gccd7d934 / v0.7.0) brings that the sync
    touches: ``init_workers`` runs ``_init_models`` (workers' init_model, weights info,
    ``_create_weight_sync_group``) and only then ``_init_async_rollout_manager``, which starts
    the vLLM servers (here: the rollout workers' ``start_engine``)."""

    def __init__(self, config, actor_wg, rollout_wg):
        self.config, self.actor_wg, self.rollout_wg = config, actor_wg, rollout_wg

    def _init_models(self):
        self.actor_wg.init_model()
        self.rollout_wg.init_model()
        self._create_weight_sync_group()

    def _init_async_rollout_manager(self):
        self.rollout_wg.start_engine()

    async def _async_gen_next_batch(self):
        from verl import DataProto

        # (metrics, timing_raw, epoch, batch, future_reward), as verl 0.7 returns it
        return {}, {}, 0, DataProto(meta_info={"global_steps": self.global_steps}), None


SETTINGS = {"transport": "shm", "bucket_mb": 1 / 128, "heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 5.0,
            "sync_timeout_s": 60.0, "connect_timeout_s": 60.0}


def trainer_config(name, **extra):
    """The trainer's config as the recipe has it: the rollout block verl turns into its strict
    RolloutConfig, weightsync's settings in their own top-level block."""
    from omegaconf import OmegaConf

    return OmegaConf.create({"actor_rollout_ref": {"rollout": {"name": "vllm", "mode": "async"}},
                             "weightsync": {**SETTINGS, "coordinator_name": name}, **extra})


@pytest.fixture
def groups(ray_cluster):
    from weightsync_verl.testing import CpuGroups

    made = CpuGroups()
    yield made
    made.close()


def make_trainer(groups, config):
    from weightsync_verl.recipe import WeightSyncTrainerMixin, with_weightsync
    from weightsync_verl.testing import StandInActor, StandInRollout

    actor_wg = groups(StandInActor, 2)
    rollout_wg = groups(StandInRollout, 1, config=config.actor_rollout_ref, role="rollout")
    return with_weightsync(StandInTrainer, WeightSyncTrainerMixin)(config, actor_wg, rollout_wg)


def test_recipe_syncs_versions_bit_exactly_and_bounds_staleness(groups):
    import ray
    from support.parties import assert_same_weights
    from weightsync_verl.testing import hf_weights

    from weightsync import StalenessError

    trainer = make_trainer(groups, trainer_config("ws-verl-recipe"))
    actor_wg, rollout_wg = trainer.actor_wg, trainer.rollout_wg
    # init_workers(): the group first, the engine after it (as vLLM's servers start)
    trainer._init_models()
    trainer._init_async_rollout_manager()

    def check_rollouts(version, syncs):
        expected = hf_weights(version)
        for got in rollout_wg.weights():
            assert_same_weights(got["weights"], expected, f"version {version}: rollout weights vs the trainer's")
            assert got["loads"] >= 2 * syncs  # several buckets per version

    try:
        # fit(): sync after loading the checkpoint (step 0), then per step: await the batch,
        # sync, launch the next generation while the update runs
        trainer.global_steps = 0
        actor_wg.set_version(0)
        trainer.sync_rollout_weights()
        check_rollouts(0, 1)
        trainer.global_steps = 1
        pending = trainer._async_gen_next_batch()
        for step in range(1, 5):
            metrics, _, _, batch, _ = asyncio.run(pending)
            assert batch.meta_info["weight_version"] == step - 1  # generated with the previous version
            assert metrics["weightsync/batch_version"] == step - 1  # and logged with the step's metrics
            actor_wg.set_version(step)
            out = trainer.sync_rollout_weights()
            assert out["weightsync/version"] == step and out["weightsync/gbps"] > 0
            assert out["weightsync/lag"] == 1 and out["timing_s/sync_rollout_weights"] > 0
            check_rollouts(step, step + 1)
            assert ray.get(rollout_wg.workers[0].weightsync_version.remote()) == step
            pending = trainer._async_gen_next_batch()
            trainer.global_steps += 1
        _, _, _, batch, _ = asyncio.run(pending)
        assert batch.meta_info["weight_version"] == 4

        # FSDP2's shards went as they are: each actor rank wrote its own half of every version
        written = actor_wg.weightsync_written()
        total = sum(t.numel() * t.element_size() for t in hf_weights(0).values())
        assert written[0] > 0 and written[1] > 0 and sum(written) == 5 * total

        # a skipped sync: the batch made with version 4 would train at step 6
        trainer.global_steps = 6
        with pytest.raises(StalenessError, match="2 versions old"):
            trainer.sync_rollout_weights()
        # reported before any byte moved: the rollout still serves version 4
        assert ray.get(rollout_wg.workers[0].weightsync_version.remote()) == 4
    finally:
        actor_wg.close()
        rollout_wg.close()
        trainer._ws_coordinator.shutdown()


def test_next_version_travels_as_soon_as_update_actor_returns(groups):
    """broadcast, receive_ahead auto (the adapter's default): the hooked update_actor stages
    the next version on both actor ranks (each sends its own FSDP2 rows) into the rollout's
    shadow at once; the step's sync then only completes the barrier. Bit-exact,
    and every such version is marked staged ahead and received ahead."""
    import ray
    from support.parties import assert_same_weights, wait_until
    from weightsync_verl.testing import hf_weights

    trainer = make_trainer(groups, trainer_config("ws-verl-ahead", weightsync={
        **SETTINGS, "transport": "broadcast", "coordinator_name": "ws-verl-ahead"}))
    trainer.actor_rollout_wg = trainer.actor_wg  # as the recipe names the group fit() trains
    trainer._init_models()
    trainer._init_async_rollout_manager()
    try:
        trainer.global_steps = 0
        trainer.actor_wg.set_version(0)
        assert trainer.sync_rollout_weights()["weightsync/staged_ahead"] == 0.0
        parties = trainer._ws_coordinator.status
        wait_until("the rollout's ahead thread came up",
                   lambda: all(p.ahead for p in parties().parties if p.role == "receiver"), timeout=30)
        for step in range(1, 4):
            trainer.actor_rollout_wg.update_actor(step)  # fit(): the update of step - 1 ...
            assert trainer._ws_ahead is not None and trainer._ws_ahead[0] == step
            trainer.global_steps = step  # ... then the next step's sync
            out = trainer.sync_rollout_weights()
            assert out["weightsync/version"] == step and out["weightsync/staged_ahead"] == 1.0, out
            m = trainer._ws_coordinator.metrics(step)
            assert m.info["ahead"] is True and all(r.received_ahead for r in m.receivers.values()), m
            for got in trainer.rollout_wg.weights():
                assert_same_weights(got["weights"], hf_weights(step), f"version {step}")
            assert ray.get(trainer.rollout_wg.workers[0].weightsync_version.remote()) == step
        # FSDP2's shards went as they are, ahead too: each actor rank broadcast its own half of
        # versions 0..3 (version 0 at the barrier, the others from the hooked update_actor)
        written = trainer.actor_wg.weightsync_written()
        total = sum(t.numel() * t.element_size() for t in hf_weights(0).values())
        assert written[0] > 0 and written[1] > 0 and sum(written) == 4 * total, written
    finally:
        trainer.actor_wg.close()
        trainer.rollout_wg.close()
        trainer._ws_coordinator.shutdown()


def test_sync_without_engine_names_the_worker_and_where_it_looked(groups):
    import ray

    trainer = make_trainer(groups, trainer_config("ws-verl-no-engine"))
    trainer._init_models()  # no _init_async_rollout_manager: vLLM never started
    try:
        with pytest.raises(ray.exceptions.RayTaskError, match=r"rollout-0 \(StandInRollout.*has no vLLM engine at the "
                                                              r"sync of version 1.*inference_engine\.worker"):
            ray.get(trainer.rollout_wg.sync_rollout_weights(1))
    finally:
        trainer.rollout_wg.close()
        trainer.actor_wg.close()
        trainer._ws_coordinator.shutdown()


def test_old_settings_key_is_refused_when_the_trainer_is_built():
    """Before any worker starts: verl's rollout workers would fail on the key with a bare
    TypeError from RolloutConfig."""
    from omegaconf import OmegaConf
    from weightsync_verl.config import ConfigKeyError
    from weightsync_verl.recipe import WeightSyncTrainerMixin, with_weightsync

    config = trainer_config("ws-verl-old-key")
    OmegaConf.update(config, "actor_rollout_ref.rollout.weight_sync", {"transport": "shm"}, force_add=True)
    with pytest.raises(ConfigKeyError, match=r"actor_rollout_ref\.rollout\.weight_sync.*\+weightsync\.transport=shm"):
        with_weightsync(StandInTrainer, WeightSyncTrainerMixin)(config, None, None)


def test_manifest_check_maps_fused_names():
    from weightsync_verl.testing import FusedModel, hf_specs
    from weightsync_vllm.target import fused_check

    from weightsync import build_manifest
    from weightsync.manifest import TensorSpec

    specs = [(n, TensorSpec(n, str(d).removeprefix("torch."), s)) for n, s, d in hf_specs()]
    check = fused_check(FusedModel(), strict=True)
    assert check(build_manifest(specs)) == []
    extra = build_manifest(specs[1:] + [("model.layers.0.self_attn.qq_proj.weight", specs[1][1])])
    problems = check(extra)
    assert any("qq_proj" in p for p in problems)  # unknown name, named
    assert any("embed_tokens" in p for p in problems)  # a parameter nothing feeds


def test_install_patches_recipe_on_import(tmp_path, monkeypatch):
    from weightsync_verl import recipe

    pkg = tmp_path / "recipe" / "one_step_off_policy"
    pkg.mkdir(parents=True)
    (tmp_path / "recipe" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "ray_trainer.py").write_text(textwrap.dedent("""
        class OneStepOffRayTrainer:
            def _create_weight_sync_group(self):
                return "nccl"

            def sync_rollout_weights(self):
                return "nccl"
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == "recipe" or m.startswith("recipe.")]:
        monkeypatch.delitem(sys.modules, name)
    recipe.install()
    try:
        from recipe.one_step_off_policy.ray_trainer import OneStepOffRayTrainer

        assert issubclass(OneStepOffRayTrainer, recipe.WeightSyncTrainerMixin)
        assert OneStepOffRayTrainer.sync_rollout_weights is recipe.WeightSyncTrainerMixin.sync_rollout_weights
        recipe.install()  # idempotent: no second layer
        assert recipe.with_weightsync(OneStepOffRayTrainer, recipe.WeightSyncTrainerMixin) is OneStepOffRayTrainer
        env = recipe.add_setup_hook({"env_vars": {"A": "1", "WEIGHTSYNC_BUCKET_MB": "8"}},
                                    environ={"WEIGHTSYNC_TRANSPORT": "shm", "WEIGHTSYNC_BUCKET_MB": "64", "HOME": "/x"})
        # the launching shell's WEIGHTSYNC_* reach the job's workers; the job's own values win
        assert env["worker_process_setup_hook"] == recipe.HOOK
        assert env["env_vars"] == {"A": "1", "WEIGHTSYNC_TRANSPORT": "shm", "WEIGHTSYNC_BUCKET_MB": "8"}
        with pytest.raises(RuntimeError, match="already has worker_process_setup_hook"):
            recipe.add_setup_hook({"worker_process_setup_hook": "other.hook"})
    finally:
        recipe.uninstall()
        for name in [m for m in sys.modules if m == "recipe" or m.startswith("recipe.")]:
            sys.modules.pop(name, None)


@pytest.mark.parametrize("init_workers, supported", [
    # verl v0.5.0 / v0.5.0-80: no group method, the group built inline in init_workers
    ('from ray.util.collective import collective\n'
     'collective.create_collective_group([], 0, [], backend="nccl", group_name="actor_rollout")', True),
    ("pass", False),  # no group method and no inline group: nothing weightsync can take over
])
def test_recipe_without_a_sync_group_method(tmp_path, monkeypatch, init_workers, supported):
    """A trainer without a group method imports patched when its init_workers builds the
    group through ray.util.collective (v0.5.0); otherwise it is refused at import, naming
    what is missing and the generations that are supported."""
    from weightsync_verl import recipe

    pkg = tmp_path / "recipe" / "one_step_off_policy"
    pkg.mkdir(parents=True)
    (tmp_path / "recipe" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    body = textwrap.indent(init_workers, " " * 8)
    (pkg / "ray_trainer.py").write_text(f"class OneStepOffRayTrainer:\n    def init_workers(self):\n{body}\n\n"
                                        "    def sync_rollout_weights(self):\n        return 'nccl'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == "recipe" or m.startswith("recipe.")]:
        monkeypatch.delitem(sys.modules, name)
    recipe.install()
    try:
        if supported:
            from recipe.one_step_off_policy.ray_trainer import OneStepOffRayTrainer

            assert issubclass(OneStepOffRayTrainer, recipe.WeightSyncTrainerMixin)
        else:
            with pytest.raises(RuntimeError, match=r"builds no sync group.*does not call ray\.util\.collective.*"
                                                   r"v0\.5\.0, v0\.5\.0-80-g796871d7, v0\.6\.1"):
                import recipe.one_step_off_policy.ray_trainer  # noqa: F401
    finally:
        recipe.uninstall()
        for name in [m for m in sys.modules if m == "recipe" or m.startswith("recipe.")]:
            sys.modules.pop(name, None)
