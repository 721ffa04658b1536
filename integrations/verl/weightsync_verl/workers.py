"""The recipe's worker side (verl 0.6-0.7 one-step-off): the actor mixins walk the
parameters on every rank; FSDP2's DTensors go to the sender as they are, so on shm every rank
writes its own rows (no all-gather), elsewhere the sender gathers them; the rollout mixin
receives into vLLM. See recipe.py for where they go."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from verl.single_controller.base.decorator import Dispatch, register
from weightsync_vllm.target import VllmTarget

from weightsync import Coordinator, Manifest, WeightReceiver, WeightSender, build_manifest
from weightsync.manifest import TensorSpec, dtype_name

# -- actor workers -----------------------------------------------------------------------------


class _ActorSide:
    _ws_sender: WeightSender | None = None
    _ws_ahead: int | None = None  # the version weightsync_stage_ahead staged on this rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def weightsync_stage_ahead(self, version: int) -> bool:
        """Stage ``version`` now, right after update_actor, while the rollout still generates
        (the trainer calls it without waiting; Ray runs this worker's calls in order, so the
        FSDP gathers of every rank meet here, in lockstep, and nowhere else). On shm the
        segment is written here, on broadcast with receive_ahead the bytes reach the
        rollouts' shadows here; sync_rollout_weights(version) then only completes the
        barrier. Returns False on rank 0 where the version would move only at the barrier
        (withdrawn: the trainer syncs a newer one as before)."""
        sender = self._ws_sender
        self._ws_ahead = None
        with self.weightsync_params() as named:
            sender.stage(version, named)
            if sender.withdraw(version, "staged after update_actor, but this transport moves it at the barrier"):
                return False
        self._ws_ahead = version
        return True

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def create_weight_sync_group(self, coordinator: Coordinator, expected_receivers: int) -> None:
        self._ws_sender = WeightSender(coordinator, rank=self.rank, name=f"actor-{self.rank}",
                                       expected_receivers=expected_receivers)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def sync_rollout_weights(self, version: int) -> dict[str, Any]:
        sender = self._ws_sender
        if sender.sends and sender.transport is None and not self.weightsync_sharded():
            manifest = self.weightsync_manifest()
            if manifest is not None:  # fixes the layout without holding a whole copy of the model
                sender.publish(manifest)
        if self._ws_ahead != version:
            with self.weightsync_params() as named:
                sender.stage(version, named)
        self._ws_ahead = None
        if not sender.sends and sender.rows is None:
            # ranks other than 0 of a session that gathers only walk the parameters: the
            # coordinator answers wait_outcome(v) with "never staged" while rank 0 has not begun
            # v, the normal order for a rank that packs nothing; rank 0's sync reports for the
            # group. A sharded session's rank sends its own rows, at the barrier on relay and
            # broadcast: it syncs as rank 0 does
            return {}
        result = sender.sync(version)
        return {"version": result.version, "bytes": result.bytes, "stage_s": result.stage_s,
                "barrier_s": result.barrier_s, "gbps": result.gbps}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def weightsync_written(self) -> int | None:
        """Bytes of its own rows this actor rank wrote so far (None: the session gathers the
        shards and rank 0 sends them; docs/sharded.md)."""
        sender = self._ws_sender
        return sender.transport.packed_bytes if sender is not None and sender.rows is not None else None

    def weightsync_manifest(self) -> Manifest | None:
        """The layout from the recipe's ``_weights_info`` [(name, shape, dtype)], if it has one."""
        info = getattr(self, "_weights_info", None)
        if not info:
            return None
        return build_manifest((n, TensorSpec(n, dtype_name(d), tuple(s))) for n, s, d in info)

    def weightsync_params(self) -> contextlib.AbstractContextManager[Iterator[tuple[str, Any]]]:
        raise NotImplementedError

    def weightsync_sharded(self) -> bool:
        """Whether the parameters reach the sender as shards (then the first version fixes the
        layout from them: it holds no whole copy of the model)."""
        return False


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
            yield ((name, params[name]) for name in order)  # DTensors stay shards: the sender decides
        finally:
            if offload:
                from verl.utils.fsdp_utils import offload_fsdp_model_to_cpu

                offload_fsdp_model_to_cpu(self.actor_module_fsdp)
            _empty_device_cache()


    def weightsync_sharded(self) -> bool:
        return any(hasattr(t, "full_tensor") for t in self._get_actor_params().values())


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
    vLLM's ``load_weights`` shards full tensors itself).

    The recipe creates the sync group before it starts vLLM (ccd7d934 / v0.7:
    ``_init_models`` -> ``_create_weight_sync_group``, then ``_init_async_rollout_manager``
    starts the servers, whose workers build ``self.rollout.inference_engine``), so the
    receiver binds to the engine at the first sync, not here."""

    _ws_receiver: WeightReceiver | None = None
    _ws_target: Any = None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def create_weight_sync_group(self, coordinator: Coordinator) -> None:
        self._ws_target = None
        self._ws_receiver = WeightReceiver(coordinator, self._ws_load, name=f"rollout-{self.rank}", rank=self.rank,
                                           post_load=self._ws_post_load, expected=self._ws_expected)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def sync_rollout_weights(self, version: int) -> dict[str, Any]:
        self._ws_bind(version)
        served = self._ws_receiver.apply(version)
        self.weightsync_clear_cache()
        last = self._ws_receiver.last_metrics  # None until a version came in
        return {"version": served, **(last.as_dict() if last is not None else {})}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def weightsync_version(self) -> int | None:
        return self._ws_receiver.version if self._ws_receiver is not None else None

    def weightsync_target(self) -> Any:
        """Object with ``load_weights``, ``post_load`` and ``expected`` (see VllmTarget)."""
        return VllmTarget.from_rollout(self.rollout)

    def _ws_bind(self, version: int | None = None) -> Any:
        if self._ws_target is None:
            try:
                self._ws_target = self.weightsync_target()
            except (RuntimeError, AttributeError) as exc:
                at = f"the sync of version {version}" if version is not None else "the first sync"
                raise RuntimeError(
                    f"rollout worker rollout-{self.rank} ({type(self).__name__}, pid {os.getpid()}) has no vLLM engine "
                    f"at {at}: {exc}. The recipe starts vLLM in _init_async_rollout_manager() after creating the "
                    "sync group; weights can only be loaded once the engine exists") from exc
        return self._ws_target

    def _ws_load(self, pairs: Any) -> Any:
        return self._ws_bind().load_weights(pairs)

    def _ws_post_load(self) -> None:
        self._ws_bind().post_load()

    def _ws_expected(self, manifest: Manifest) -> list[str]:
        check = self._ws_bind().expected
        return list(check(manifest)) if check is not None else []

    def weightsync_clear_cache(self) -> None:
        """Drop KV blocks computed with the old weights, where the engine lives in this process
        (vLLM's offline ``LLM``). The async servers' caches are cleared by the trainer."""
        engine = getattr(getattr(self, "rollout", None), "inference_engine", None)
        reset = getattr(engine, "reset_prefix_cache", None)
        if callable(reset):
            reset()
