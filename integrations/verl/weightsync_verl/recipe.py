"""Adapter for verl's one-step-off-policy recipe (``recipe/one_step_off_policy``, verl v0.5.0
to 0.7).

The recipe builds its sync group with ``ray.util.collective`` (NCCL only; "NCCL is not
available" on Ascend) and broadcasts one tensor at a time. These mixins (the workers' in workers.py) replace
exactly the methods involved, keeping the recipe's call pattern:

    trainer._create_weight_sync_group()   driver: start the coordinator, hand it to workers
                                          (v0.5.0 / v0.5.0-80 have no such method: their
                                          init_workers() calls ray.util.collective inline, and
                                          that one call is taken over, see inline_group.py)
    trainer.sync_rollout_weights()        actor_wg.sync_rollout_weights(v)        (not awaited)
                                          ray.get(rollout_wg.sync_rollout_weights(v))
    actor worker: every rank iterates the parameters in lockstep (``full_tensor()`` and
                  Megatron's gathers are collectives); rank 0 sends through WeightSender
    rollout worker: WeightReceiver -> vLLM ``load_weights`` per bucket -> post-load once

Use:  ``python -m weightsync_verl.one_step_off <the recipe's Hydra overrides> +weightsync.<key>=...``,
or call ``install()`` before the recipe modules are used (it patches them as they are
imported). Generations: see ``PATCHES`` and docs/verl.md.
"""

from __future__ import annotations

import inspect
import os
import sys
import time
from typing import Any

import ray

from weightsync import Coordinator
from weightsync.config import ENV_PREFIX

from .config import refuse_old_key, sync_config
from .import_hook import after_import, put_in_front, remove, with_mixin
from .inline_group import GroupRequest, take_over_group
from .logger_metrics import digest_metrics
from .tagging import VersionLedger, agreed_version, next_version, stamp_all
from .workers import FSDPActorWeightSyncMixin, MegatronActorWeightSyncMixin, RolloutWeightSyncMixin

__all__ = ["FSDPActorWeightSyncMixin", "MegatronActorWeightSyncMixin", "RolloutWeightSyncMixin",
           "WeightSyncTrainerMixin", "install", "uninstall", "enable_in_ray_workers", "add_setup_hook", "PATCHES"]

RECIPE = "recipe.one_step_off_policy"
GROUP = "actor_rollout"  # the recipe's name for its sync group, at every generation


# -- trainer (driver) --------------------------------------------------------------------------


class WeightSyncTrainerMixin:
    """Put before ``OneStepOffRayTrainer`` in the bases. Needs ``self.config``,
    ``self.actor_wg`` and ``self.rollout_wg`` as the recipe sets them."""

    weightsync_metrics: dict[str, float]

    def __init__(self, config: Any, *args: Any, **kwargs: Any):
        # before any worker starts: verl's rollout workers would fail on the old key with a
        # bare TypeError from RolloutConfig
        refuse_old_key(config)
        super().__init__(config, *args, **kwargs)

    def _create_weight_sync_group(self) -> None:
        # receive_ahead auto unless the user says otherwise: the next version travels while
        # the rollout still generates (weightsync_stage_ahead), where the ahead copy fits
        cfg = sync_config(self.config, receive_ahead="auto")
        receivers = self.rollout_wg.world_size
        self._ws_coordinator = Coordinator.create(cfg)
        self._ws_ledger = VersionLedger(cfg.max_staleness, self._ws_coordinator)
        self._ws_version: int | None = None
        self._ws_stage_ahead = cfg.receive_ahead != "off"
        self._ws_ahead: tuple[int, list] | None = None  # (version, the actor ranks' refs)
        self.weightsync_metrics = {}
        # actors only register here; the rollout side checks nothing before the first manifest
        actor = self.actor_wg.create_weight_sync_group(self._ws_coordinator, receivers)
        ray.get(self.rollout_wg.create_weight_sync_group(self._ws_coordinator))
        ray.get(actor)

    # verl 0.6 spells the trainer method without the underscore
    def create_weight_sync_group(self) -> None:
        self._create_weight_sync_group()

    def init_workers(self, *args: Any, **kwargs: Any) -> Any:
        # v0.5.0 / v0.5.0-80 create the group inline here (ray.util.collective, NCCL) and sync
        # at once; later generations call the method above and never reach the taken-over entry
        with take_over_group(GROUP, self._ws_inline_group):
            return super().init_workers(*args, **kwargs)

    def _ws_inline_group(self, request: GroupRequest) -> None:
        expected = self.actor_wg.world_size + self.rollout_wg.world_size
        if request.world_size != expected or len(request.actors) != expected:
            raise RuntimeError(
                f"the recipe asked for group {GROUP!r} over {len(request.actors)} actors (world_size "
                f"{request.world_size}), not the {self.actor_wg.world_size} actor + {self.rollout_wg.world_size} "
                "rollout workers weightsync connects: this recipe generation builds another group than v0.5.0's")
        self._create_weight_sync_group()

    def sync_rollout_weights(self) -> dict[str, float]:
        if getattr(self, "_ws_coordinator", None) is None:
            raise RuntimeError(
                f"{type(self).__name__}.sync_rollout_weights() ran before any weight sync group was created: this "
                f"recipe's init_workers() neither called create_weight_sync_group / _create_weight_sync_group nor "
                f"ray.util.collective.create_collective_group(group_name={GROUP!r}). {SUPPORTED}")
        self._ws_hook_update_actor()
        version = next_version(getattr(self, "global_steps", None), self._ws_version)
        t0 = time.perf_counter()
        version, ahead = self._ws_take_ahead(version)
        ahead_wait = time.perf_counter() - t0
        self._ws_ledger.before_sync(version)  # raises StalenessError on a batch older than the bound
        actor_refs = self.actor_wg.sync_rollout_weights(version)  # as the recipe: senders not awaited first
        served = ray.get(self.rollout_wg.sync_rollout_weights(version))
        sent = ray.get(actor_refs)
        elapsed = time.perf_counter() - t0
        self._ws_version = version
        self._ws_ledger.served = agreed_version([s["version"] for s in served])
        self._ws_clear_kv_cache()
        result = next((s for s in sent if s), {})
        self.weightsync_metrics = {
            "timing_s/sync_rollout_weights": elapsed,
            "weightsync/gbps": result.get("bytes", 0) / elapsed / 1e9 if elapsed > 0 else 0.0,
            "weightsync/version": version,
            "weightsync/stage_s": result.get("stage_s", 0.0),
            "weightsync/barrier_s": result.get("barrier_s", 0.0),
            # 1: staged right after update_actor (and, with receive_ahead, already at the rollouts)
            "weightsync/staged_ahead": float(ahead),
            "weightsync/ahead_wait_s": ahead_wait,
            # trainer and every rollout hold the same bytes: their version digests agree
            **digest_metrics(self._ws_coordinator.metrics(version)),
        }
        if self._ws_ledger.last_lag is not None:
            self.weightsync_metrics["weightsync/lag"] = self._ws_ledger.last_lag
        return self.weightsync_metrics

    def _ws_hook_update_actor(self) -> None:
        """Stage the next version as soon as the driver's update_actor returns (the recipe's
        fit() calls ``self.actor_rollout_wg.update_actor(batch)``, the actor group itself)."""
        wg = getattr(self, "actor_rollout_wg", None)
        if not self._ws_stage_ahead or wg is None or wg is not self.actor_wg or getattr(wg, "_ws_hooked", False):
            return
        update, trainer = wg.update_actor, self

        def update_actor(*args: Any, **kwargs: Any) -> Any:
            out = update(*args, **kwargs)
            trainer.weightsync_stage_ahead()
            return out

        wg.update_actor, wg._ws_hooked = update_actor, True

    def weightsync_stage_ahead(self) -> int | None:
        """Right after the optimizer step: stage the version the next sync will carry on every
        actor rank, without waiting (the rollout generates meanwhile); returns it, or None
        where the transport would read the weights only at the barrier anyway (ipc, streaming
        shm) or before the first sync fixed the transport."""
        if not self._ws_stage_ahead or self._ws_version is None or not self._ws_coordinator.status().pipelined:
            return None
        last = self._ws_version if self._ws_ahead is None else max(self._ws_version, self._ws_ahead[0])
        version = next_version((getattr(self, "global_steps", None) or 0) + 1, last)
        self._ws_ahead = (version, self.actor_wg.weightsync_stage_ahead(version))
        return version

    def _ws_take_ahead(self, version: int) -> tuple[int, bool]:
        """The version this sync carries, and whether it was staged ahead. A version staged
        ahead that was withdrawn (it would move at the barrier) or failed on its way is
        passed over: the sync stages the next integer, as today."""
        if self._ws_ahead is None:
            return version, False
        ahead, refs = self._ws_ahead
        self._ws_ahead = None
        staged = all(ray.get(refs)) and self._ws_coordinator.metrics(ahead).state == "STAGED"
        if staged and ahead >= version:
            return ahead, True
        self._ws_version = max(ahead, self._ws_version or 0)
        return next_version(getattr(self, "global_steps", None), self._ws_version), False

    def _ws_clear_kv_cache(self) -> None:
        clear = getattr(getattr(self, "async_rollout_manager", None), "clear_kv_cache", None)
        # a coroutine version (verl 0.7) is awaited by the recipe's fit() right after the sync
        if clear is not None and not inspect.iscoroutinefunction(clear):
            clear()

    def _async_gen_next_batch(self, *args: Any, **kwargs: Any) -> Any:
        result = super()._async_gen_next_batch(*args, **kwargs)
        if result is None:
            return None
        # read after the call: verl 0.6 syncs inside it, 0.7 before it (coroutine not yet run)
        version = self._ws_ledger.launched()
        if inspect.isawaitable(result):
            return self._ws_tagged(result, version)
        return stamp_all(result, version)

    async def _ws_tagged(self, pending: Any, version: int | None) -> Any:
        result = await pending
        if isinstance(result, tuple) and result and isinstance(result[0], dict):
            result[0].update(self.weightsync_metrics)  # verl 0.7: (metrics, timing, epoch, batch, ...)
            if version is not None:  # the batch's tag in verl's per-step log (one-step-off: step - 1)
                result[0]["weightsync/batch_version"] = version
        return stamp_all(result, version) if result is not None else None

    def weightsync_status(self) -> str:
        return self._ws_coordinator.format_status()


# -- applying it to the recipe -----------------------------------------------------------------

# recipe module -> {class name: the mixin that goes in front of it}; the names each
# generation's main_ppo maps Role.Actor / Role.Rollout to
_WORKERS = {
    "DetachActorWorker": "actor",  # v0.5.0-716 (ccd7d934), v0.7.0
    "DetachAsyncRolloutWorker": "rollout",  # v0.5.0-716 (ccd7d934), v0.7.0
    "ActorRolloutRefWorker": "actor",  # v0.5.0, v0.5.0-80 (796871d7), v0.6.1 (rollout.mode=sync)
    "RolloutWorker": "rollout",  # v0.5.0, v0.5.0-80, v0.6.1
}
PATCHES = {
    f"{RECIPE}.ray_trainer": {"OneStepOffRayTrainer": WeightSyncTrainerMixin},
    f"{RECIPE}.fsdp_workers": {n: FSDPActorWeightSyncMixin if r == "actor" else RolloutWeightSyncMixin
                               for n, r in _WORKERS.items()},
    f"{RECIPE}.megatron_workers": {n: MegatronActorWeightSyncMixin if r == "actor" else RolloutWeightSyncMixin
                                   for n, r in _WORKERS.items()},
}
SUPPORTED = ("weightsync supports the recipe of verl v0.5.0, v0.5.0-80-g796871d7, v0.6.1, v0.5.0-716-gccd7d934 and "
             "v0.7.0; on verl >= 0.8 use the checkpoint-engine backend "
             "(checkpoint_engine.custom_backend_module=weightsync_verl.checkpoint_engine)")
UNSUPPORTED = (
    "{module}.OneStepOffRayTrainer builds no sync group weightsync can take over: it has no "
    "create_weight_sync_group / _create_weight_sync_group method, and its init_workers() does not call "
    "ray.util.collective's create_collective_group (as v0.5.0 does inline). " + SUPPORTED)


def with_weightsync(cls: type, mixin: type) -> type:
    """``cls`` with ``mixin`` in front; the same class back if it already has it."""
    return with_mixin(cls, mixin, __name__)


def patch_module(module: Any) -> list[str]:
    """Replace the recipe's classes in ``module`` by their weightsync versions."""
    done = []
    for name, mixin in PATCHES.get(module.__name__, {}).items():
        if isinstance(getattr(module, name, None), type):
            put_in_front(module, name, mixin, __name__)
            done.append(name)
    if module.__name__.endswith("ray_trainer") and "OneStepOffRayTrainer" in done:
        trainer = module.OneStepOffRayTrainer
        bases = trainer.__mro__[2:]
        if not any(hasattr(b, "sync_rollout_weights") for b in bases):
            raise RuntimeError(f"{module.__name__}.OneStepOffRayTrainer has no sync_rollout_weights: this verl "
                               "generation syncs through its checkpoint engine; use weightsync_verl.checkpoint_engine")
        if not any(hasattr(b, m) for b in bases for m in ("create_weight_sync_group", "_create_weight_sync_group")) \
                and not _creates_group_inline(bases[0]):
            raise RuntimeError(UNSUPPORTED.format(module=module.__name__))
    return done


def _creates_group_inline(trainer: type) -> bool:
    """Whether the recipe's own init_workers() calls ray.util.collective's create_collective_group
    (v0.5.0, v0.5.0-80); True where its source cannot be read (the sync then fails with a
    message if no group was made)."""
    try:
        source = inspect.getsource(trainer.init_workers)
    except (OSError, TypeError, AttributeError):
        return True
    return "create_collective_group" in source


def install() -> None:
    """Patch the recipe in this process: modules already imported now, the others as they
    are imported. Idempotent; cheap (imports nothing of the recipe itself)."""
    after_import(__name__, dict.fromkeys(PATCHES, patch_module))
    for name in PATCHES:
        if name in sys.modules:
            patch_module(sys.modules[name])


def uninstall() -> None:
    """Stop patching recipe modules as they are imported (those patched stay patched)."""
    remove(__name__)


HOOK = f"{__name__}.install"


def add_setup_hook(runtime_env: dict | None, environ: dict[str, str] | None = None) -> dict:
    """For ``RAY_RUNTIME_ENV_HOOK``: every Ray worker runs ``install()`` at start-up, so the
    recipe's task runner (a Ray actor) builds the patched trainer and worker classes. The
    launching shell's ``WEIGHTSYNC_*`` variables go into the job's ``env_vars``: on a
    ``ray start`` cluster the workers inherit the raylet's environment, not this one's."""
    env = dict(runtime_env or {})
    current = env.get("worker_process_setup_hook")
    if current not in (None, HOOK):
        raise RuntimeError(f"runtime_env already has worker_process_setup_hook={current!r}; "
                           f"call {HOOK}() from it to use weightsync")
    env["worker_process_setup_hook"] = HOOK
    ours = {k: v for k, v in (os.environ if environ is None else environ).items() if k.startswith(ENV_PREFIX)}
    if ours:
        env["env_vars"] = {**ours, **(env.get("env_vars") or {})}  # the job's own values win
    return env


def enable_in_ray_workers() -> None:
    """Make the next ``ray.init`` of this process install the patch in every Ray worker."""
    os.environ["RAY_RUNTIME_ENV_HOOK"] = f"{__name__}.add_setup_hook"
