"""Stage the next version right after ``update_actor`` in verl >= 0.8's one-step-off trainer
(``verl.experimental.one_step_off_policy``), which syncs through the checkpoint-engine
backend (checkpoint_engine.py) and has no hook of its own between the update and the sync.

verl 0.9.1's step s: await batch s-1 -> ``_fit_update_weights()`` (the sync) -> launch
generation s -> ... -> ``_fit_update_actor()``. Version s+1's weights are final when the
update returns, while generation s still runs; the sync of step s+1 waits for them only
then. With this mixin in front of ``OneStepOffRayTrainer``:

    _fit_update_actor()     ... then arm the actor ranks and call their update_weights(s+1):
                            every rank walks its parameters (FSDP gathers meet in that call,
                            in lockstep), rank 0 stages; on broadcast with receive_ahead the
                            bytes reach the rollouts' shadows, while generation s runs on
    _fit_update_weights()   ask every rank whether the version stands, tell all the verdict;
                            then verl's own sync, which only completes the barrier (or stages
                            afresh where the early version fell through)

Use: ``VERL_USE_EXTERNAL_MODULES=weightsync_verl.plugin_stage_ahead`` (verl imports it in
every process, and it calls ``install()``: the trainer is patched as it is imported), or
``install()`` before ``verl.experimental.one_step_off_policy.ray_trainer`` is used. The
checkpoint engine's ``receive_ahead`` becomes ``auto`` unless
``engine_kwargs.weightsync.receive_ahead`` is given.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from .import_hook import after_import, put_in_front

TRAINER_MODULE = "verl.experimental.one_step_off_policy.ray_trainer"
BACKEND = "weightsync"


class StageAheadMixin:
    """In front of verl's ``OneStepOffRayTrainer`` (a ``SeparateRayPPOTrainer``)."""

    _ws_ahead: tuple[int, float] | None = None  # (the step whose sync carries it, seconds staging took)

    def init_workers(self) -> Any:
        default_receive_ahead(self.config)  # before any worker reads the engine's kwargs
        return super().init_workers()

    def _fit_update_actor(self, batch: Any) -> Any:
        batch = super()._fit_update_actor(batch)
        self.weightsync_stage_ahead()
        return batch

    def _fit_update_weights(self) -> Any:
        kept = self._ws_settle_ahead()
        out = super()._fit_update_weights()
        if kept is not None:
            self.metrics.update({"weightsync/staged_ahead": float(kept[0]), "weightsync/ahead_stage_s": kept[1]})
        return out

    def weightsync_stage_ahead(self) -> bool:
        """Stage the version the next sync carries, now; False where no sync follows (the last
        step, critic warm-up) or the backend is not weightsync.

        The trainer waits for it here: the rollout generates in its own servers meanwhile, and
        no other call reaches the actor ranks before every rank finished its walk (verl's
        actor workers are asyncio actors, which do not promise to run calls in the order sent)."""
        import ray

        cfg = self.config
        if cfg.actor_rollout_ref.rollout.checkpoint_engine.backend != BACKEND:
            return False
        step = self.global_steps + 1  # the step whose sync carries these weights
        if self.is_last_step or cfg.trainer.critic_warmup > step:
            return False
        wg = self.checkpoint_manager.actor_wg
        ray.get(wg.execute_checkpoint_engine(["arm_ahead"] * wg.world_size))
        t0 = time.perf_counter()
        ray.get(wg.update_weights(global_steps=step))  # a failure of the walk itself is raised here, as verl's sync would
        self._ws_ahead = (step, time.perf_counter() - t0)
        return True

    def _ws_settle_ahead(self) -> tuple[bool, float] | None:
        """None where nothing was staged ahead for this step; else whether the sync uses it,
        told to every rank alike (one rank walking its parameters alone would hang FSDP), and
        the seconds it took to stage."""
        if self._ws_ahead is None:
            return None
        import ray

        (step, seconds), self._ws_ahead = self._ws_ahead, None
        wg = self.checkpoint_manager.actor_wg
        keep = step == self.global_steps and all(ray.get(wg.execute_checkpoint_engine(["ahead_usable"] * wg.world_size)))
        ray.get(wg.execute_checkpoint_engine(["keep_ahead"] * wg.world_size, [keep] * wg.world_size))
        return keep, seconds


def default_receive_ahead(config: Any) -> None:
    """engine_kwargs.weightsync.receive_ahead = auto unless given: the rollouts take a version
    sent ahead into their shadows while they generate."""
    from omegaconf import open_dict

    ce = config.actor_rollout_ref.rollout.checkpoint_engine
    if ce.backend != BACKEND:
        return
    with open_dict(ce):
        if ce.get("engine_kwargs") is None:
            ce.engine_kwargs = {}
        if ce.engine_kwargs.get("weightsync") is None:
            ce.engine_kwargs.weightsync = {}
        if "receive_ahead" not in ce.engine_kwargs.weightsync:
            ce.engine_kwargs.weightsync.receive_ahead = "auto"


def patch_module(module: Any) -> None:
    if isinstance(getattr(module, "OneStepOffRayTrainer", None), type):
        put_in_front(module, "OneStepOffRayTrainer", StageAheadMixin, __name__)


def install() -> None:
    """Patch the trainer in this process, now if imported, else as it is imported. Idempotent."""
    after_import(__name__, {TRAINER_MODULE: patch_module})
    if TRAINER_MODULE in sys.modules:
        patch_module(sys.modules[TRAINER_MODULE])
