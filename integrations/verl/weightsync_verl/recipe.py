"""Adapter for verl's one-step-off-policy recipe (``recipe/one_step_off_policy``, verl 0.5-0.7).

The recipe builds its sync group with ``ray.util.collective`` (NCCL only; "NCCL is not
available" on Ascend) and broadcasts one tensor at a time. These mixins replace exactly the
four methods involved, keeping the recipe's call pattern:

    trainer._create_weight_sync_group()   driver: start the coordinator, hand it to workers
    trainer.sync_rollout_weights()        actor_wg.sync_rollout_weights(v)        (not awaited)
                                          ray.get(rollout_wg.sync_rollout_weights(v))
    actor worker: every rank iterates the parameters in lockstep (``full_tensor()`` and
                  Megatron's gathers are collectives); rank 0 sends through WeightSender
    rollout worker: WeightReceiver -> vLLM ``load_weights`` per bucket -> post-load once

Use:  ``python -m weightsync_verl.one_step_off <the recipe's Hydra overrides>``, or call
:func:`install` before the recipe modules are used (it patches them as they are imported).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import inspect
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import ray
from verl.single_controller.base.decorator import Dispatch, register

from weightsync import Coordinator, Manifest, WeightReceiver, WeightSender, build_manifest
from weightsync.digest import metrics as digest_metrics
from weightsync.manifest import TensorSpec, dtype_name

from .config import sync_config
from .tagging import VersionLedger, agreed_version, next_version, stamp_all
from .vllm_engine import VllmTarget

RECIPE = "recipe.one_step_off_policy"


# -- trainer (driver) --------------------------------------------------------------------------


class WeightSyncTrainerMixin:
    """Put before ``OneStepOffRayTrainer`` in the bases. Needs ``self.config``,
    ``self.actor_wg`` and ``self.rollout_wg`` as the recipe sets them."""

    weightsync_metrics: dict[str, float]

    def _create_weight_sync_group(self) -> None:
        cfg = sync_config(self.config)
        receivers = self.rollout_wg.world_size
        self._ws_coordinator = Coordinator.create(cfg)
        self._ws_ledger = VersionLedger(cfg.max_staleness, self._ws_coordinator)
        self._ws_version: int | None = None
        self.weightsync_metrics = {}
        # actors only register here; the rollout side checks nothing before the first manifest
        actor = self.actor_wg.create_weight_sync_group(self._ws_coordinator, receivers)
        ray.get(self.rollout_wg.create_weight_sync_group(self._ws_coordinator))
        ray.get(actor)

    # verl 0.6 spells the trainer method without the underscore
    def create_weight_sync_group(self) -> None:
        self._create_weight_sync_group()

    def sync_rollout_weights(self) -> dict[str, float]:
        version = next_version(getattr(self, "global_steps", None), self._ws_version)
        self._ws_ledger.before_sync(version)  # raises StalenessError on a batch older than the bound
        t0 = time.perf_counter()
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
            # trainer and every rollout hold the same bytes: their version digests agree
            **digest_metrics(self._ws_coordinator.metrics(version)),
        }
        if self._ws_ledger.last_lag is not None:
            self.weightsync_metrics["weightsync/lag"] = self._ws_ledger.last_lag
        return self.weightsync_metrics

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
        return stamp_all(result, version) if result is not None else None

    def weightsync_status(self) -> str:
        return self._ws_coordinator.format_status()


# -- actor workers -----------------------------------------------------------------------------


class _ActorSide:
    _ws_sender: WeightSender | None = None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def create_weight_sync_group(self, coordinator: Coordinator, expected_receivers: int) -> None:
        self._ws_sender = WeightSender(coordinator, rank=self.rank, name=f"actor-{self.rank}",
                                       expected_receivers=expected_receivers)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def sync_rollout_weights(self, version: int) -> dict[str, Any]:
        sender = self._ws_sender
        if sender.sends and sender.transport is None:
            manifest = self.weightsync_manifest()
            if manifest is not None:  # fixes the layout without holding a whole copy of the model
                sender.publish(manifest)
        with self.weightsync_params() as named:
            sender.stage(version, named)
        if not sender.sends:
            # ranks other than 0 only walk the parameters: the coordinator answers
            # wait_outcome(v) with "never staged" while rank 0 has not begun v, the normal
            # order for a rank that packs nothing; rank 0's sync reports for the group
            return {}
        result = sender.sync(version)
        return {"version": result.version, "bytes": result.bytes, "stage_s": result.stage_s,
                "barrier_s": result.barrier_s, "gbps": result.gbps}

    def weightsync_manifest(self) -> Manifest | None:
        """The layout from the recipe's ``_weights_info`` [(name, shape, dtype)], if it has one."""
        info = getattr(self, "_weights_info", None)
        if not info:
            return None
        return build_manifest((n, TensorSpec(n, dtype_name(d), tuple(s))) for n, s, d in info)

    def weightsync_params(self) -> contextlib.AbstractContextManager[Iterator[tuple[str, Any]]]:
        raise NotImplementedError


class FSDPActorWeightSyncMixin(_ActorSide):
    """For the recipe's FSDP ``DetachActorWorker`` (``_get_actor_params``)."""

    @contextlib.contextmanager
    def weightsync_params(self) -> Iterator[Iterator[tuple[str, Any]]]:
        offload = getattr(self, "_is_offload_param", False)
        if offload:
            from verl.utils.fsdp_utils import load_fsdp_model_to_gpu

            load_fsdp_model_to_gpu(self.actor_module_fsdp)
        try:
            params = self._get_actor_params()
            info = getattr(self, "_weights_info", None)
            order = [n for n, *_ in info] if info else list(params)
            yield _full_tensors(params, order)
        finally:
            if offload:
                from verl.utils.fsdp_utils import offload_fsdp_model_to_cpu

                offload_fsdp_model_to_cpu(self.actor_module_fsdp)
            _empty_device_cache()


def _full_tensors(params: Any, order: list[str]) -> Iterator[tuple[str, Any]]:
    for name in order:
        tensor = params[name]
        if hasattr(tensor, "full_tensor"):
            tensor = tensor.full_tensor()  # collective over the FSDP ranks: every rank gets here
        yield name, tensor


class MegatronActorWeightSyncMixin(_ActorSide):
    """For the recipe's Megatron ``DetachActorWorker`` (``_get_actor_params_generator``)."""

    @contextlib.contextmanager
    def weightsync_params(self) -> Iterator[Iterator[tuple[str, Any]]]:
        offload = getattr(self, "_is_offload_param", False)
        if offload:
            from verl.utils.megatron_utils import load_megatron_model_to_gpu

            load_megatron_model_to_gpu(self.actor_module)
        try:
            yield iter(self._get_actor_params_generator())
        finally:
            if offload:
                from verl.utils.megatron_utils import offload_megatron_model_to_cpu

                offload_megatron_model_to_cpu(self.actor_module)
            _empty_device_cache()


def _empty_device_cache() -> None:
    with contextlib.suppress(Exception):
        from verl.utils.device import get_torch_device

        get_torch_device().empty_cache()


# -- rollout workers ---------------------------------------------------------------------------


class RolloutWeightSyncMixin:
    """For the recipe's rollout worker (vLLM): one WeightReceiver per worker (per TP rank;
    vLLM's ``load_weights`` shards full tensors itself)."""

    _ws_receiver: WeightReceiver | None = None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def create_weight_sync_group(self, coordinator: Coordinator) -> None:
        target = self.weightsync_target()
        self._ws_target = target
        self._ws_receiver = WeightReceiver(coordinator, target.load_weights, name=f"rollout-{self.rank}",
                                           rank=self.rank, post_load=target.post_load, expected=target.expected)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def sync_rollout_weights(self, version: int) -> dict[str, Any]:
        served = self._ws_receiver.apply(version)
        self.weightsync_clear_cache()
        return {"version": served, **self._ws_receiver.last_metrics}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def weightsync_version(self) -> int | None:
        return self._ws_receiver.version if self._ws_receiver is not None else None

    def weightsync_target(self) -> Any:
        """Object with ``load_weights``, ``post_load`` and ``expected`` (see VllmTarget)."""
        return VllmTarget.from_rollout(self.rollout)

    def weightsync_clear_cache(self) -> None:
        """Drop KV blocks computed with the old weights, where the engine lives in this process
        (vLLM's offline ``LLM``). The async servers' caches are cleared by the trainer."""
        engine = getattr(getattr(self, "rollout", None), "inference_engine", None)
        reset = getattr(engine, "reset_prefix_cache", None)
        if callable(reset):
            reset()


# -- applying it to the recipe -----------------------------------------------------------------

# recipe module -> {class name: the mixin that goes in front of it}
PATCHES = {
    f"{RECIPE}.ray_trainer": {"OneStepOffRayTrainer": WeightSyncTrainerMixin},
    f"{RECIPE}.fsdp_workers": {"DetachActorWorker": FSDPActorWeightSyncMixin,
                               "ActorRolloutRefWorker": FSDPActorWeightSyncMixin,
                               "DetachAsyncRolloutWorker": RolloutWeightSyncMixin,
                               "RolloutWorker": RolloutWeightSyncMixin,
                               "AsyncRolloutWorker": RolloutWeightSyncMixin},
    f"{RECIPE}.megatron_workers": {"DetachActorWorker": MegatronActorWeightSyncMixin,
                                   "ActorRolloutRefWorker": MegatronActorWeightSyncMixin,
                                   "DetachAsyncRolloutWorker": RolloutWeightSyncMixin,
                                   "RolloutWorker": RolloutWeightSyncMixin,
                                   "AsyncRolloutWorker": RolloutWeightSyncMixin},
}


def with_weightsync(cls: type, mixin: type) -> type:
    """``cls`` with ``mixin`` in front; the same class back if it already has it."""
    if issubclass(cls, mixin):
        return cls
    return type(cls.__name__, (mixin, cls), {"__module__": __name__, "__qualname__": f"with_weightsync.{cls.__name__}",
                                            "__doc__": cls.__doc__})


def patch_module(module: Any) -> list[str]:
    """Replace the recipe's classes in ``module`` by their weightsync versions."""
    done = []
    for name, mixin in PATCHES.get(module.__name__, {}).items():
        cls = getattr(module, name, None)
        if isinstance(cls, type):
            setattr(module, name, with_weightsync(cls, mixin))
            done.append(name)
    if module.__name__.endswith("ray_trainer") and "OneStepOffRayTrainer" in done:
        trainer = module.OneStepOffRayTrainer
        if not any(hasattr(b, "sync_rollout_weights") for b in trainer.__mro__[2:]):
            raise RuntimeError(f"{module.__name__}.OneStepOffRayTrainer has no sync_rollout_weights: this verl "
                               "generation syncs through its checkpoint engine; use weightsync_verl.checkpoint_engine")
    return done


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner: Any):
        self.inner = inner

    def create_module(self, spec: Any) -> Any:
        return self.inner.create_module(spec) if hasattr(self.inner, "create_module") else None

    def exec_module(self, module: Any) -> None:
        self.inner.exec_module(module)
        patch_module(module)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches a recipe module right after it executes, wherever it is first imported."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in PATCHES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                spec.loader = _PatchingLoader(spec.loader)
                return spec
        return None


def install() -> None:
    """Patch the recipe in this process: modules already imported now, the others as they
    are imported. Idempotent; cheap (imports nothing of the recipe itself)."""
    if not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())
    for name in PATCHES:
        if name in sys.modules:
            patch_module(sys.modules[name])


HOOK = f"{__name__}.install"


def add_setup_hook(runtime_env: dict | None) -> dict:
    """For ``RAY_RUNTIME_ENV_HOOK``: every Ray worker runs :func:`install` at start-up, so the
    recipe's task runner (a Ray actor) builds the patched trainer and worker classes."""
    env = dict(runtime_env or {})
    current = env.get("worker_process_setup_hook")
    if current not in (None, HOOK):
        raise RuntimeError(f"runtime_env already has worker_process_setup_hook={current!r}; "
                           f"call {HOOK}() from it to use weightsync")
    env["worker_process_setup_hook"] = HOOK
    return env


def enable_in_ray_workers() -> None:
    """Make the next ``ray.init`` of this process install the patch in every Ray worker."""
    os.environ["RAY_RUNTIME_ENV_HOOK"] = f"{__name__}.add_setup_hook"
