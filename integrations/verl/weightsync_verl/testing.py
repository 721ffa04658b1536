"""Stand-ins for verl's workers and a vLLM model, used by the tests (they must be importable
in Ray worker processes, hence a module of the package). Real weightsync parties, real verl
worker groups and dispatch; only the models are tiny."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import torch
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register

from .recipe import FSDPActorWeightSyncMixin, RolloutWeightSyncMixin
from .vllm_engine import VllmTarget

HIDDEN, KV, FFN, VOCAB, LAYERS = 32, 16, 48, 64, 2


def hf_specs() -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """A Qwen2-shaped model with HF names (separate q/k/v and gate/up), bf16 with fp32 norms."""
    specs = [("model.embed_tokens.weight", (VOCAB, HIDDEN), torch.bfloat16)]
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        specs += [
            (p + "self_attn.q_proj.weight", (HIDDEN, HIDDEN), torch.bfloat16),
            (p + "self_attn.q_proj.bias", (HIDDEN,), torch.bfloat16),
            (p + "self_attn.k_proj.weight", (KV, HIDDEN), torch.bfloat16),
            (p + "self_attn.k_proj.bias", (KV,), torch.bfloat16),
            (p + "self_attn.v_proj.weight", (KV, HIDDEN), torch.bfloat16),
            (p + "self_attn.v_proj.bias", (KV,), torch.bfloat16),
            (p + "self_attn.o_proj.weight", (HIDDEN, HIDDEN), torch.bfloat16),
            (p + "mlp.gate_proj.weight", (FFN, HIDDEN), torch.bfloat16),
            (p + "mlp.up_proj.weight", (FFN, HIDDEN), torch.bfloat16),
            (p + "mlp.down_proj.weight", (HIDDEN, FFN), torch.bfloat16),
            (p + "input_layernorm.weight", (HIDDEN,), torch.float32),
            (p + "post_attention_layernorm.weight", (HIDDEN,), torch.float32),
        ]
    return specs + [("model.norm.weight", (HIDDEN,), torch.float32), ("lm_head.weight", (VOCAB, HIDDEN), torch.bfloat16)]


def hf_weights(version: int) -> dict[str, torch.Tensor]:
    """The trainer's weights at ``version``: random bits (NaN payloads and -0.0 included)."""
    g = torch.Generator().manual_seed(1000 + version)
    out = {}
    for name, shape, dtype in hf_specs():
        n = torch.Size(shape).numel() * dtype.itemsize
        raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
        out[name] = raw.view(dtype).reshape(shape)
    return out


class FusedModel:
    """vLLM-style model: q/k/v fused into ``qkv_proj``, gate/up into ``gate_up_proj``;
    ``load_weights`` maps HF names through a stacked-params table and loads each shard into
    its slice, as vLLM's Qwen2 loader does. ``post_load`` counts calls."""

    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    stacked_params_mapping = [  # (fused param, HF shard, shard id)
        ("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1),
    ]

    def __init__(self) -> None:
        self.params: dict[str, torch.Tensor] = {}
        for name, shape, dtype in hf_specs():
            for fused, shard, _ in self.stacked_params_mapping:
                if f".{shard}." in name:
                    name = name.replace(f".{shard}.", f".{fused}.")
                    rows = {"qkv_proj": HIDDEN + 2 * KV, "gate_up_proj": 2 * FFN}[fused]
                    shape = (rows, *shape[1:])
                    break
            self.params.setdefault(name, torch.zeros(shape, dtype=dtype))
        self.loads = self.post_loads = 0

    def named_parameters(self) -> Iterable[tuple[str, torch.Tensor]]:
        return iter(self.params.items())

    @staticmethod
    def _slice(fused: str, shard_id: Any) -> slice:
        if fused == "qkv_proj":
            start = {"q": 0, "k": HIDDEN, "v": HIDDEN + KV}[shard_id]
            return slice(start, start + (HIDDEN if shard_id == "q" else KV))
        return slice(shard_id * FFN, (shard_id + 1) * FFN)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = set()
        for name, tensor in weights:
            for fused, shard, shard_id in self.stacked_params_mapping:
                if f".{shard}." not in name:
                    continue
                target = name.replace(f".{shard}.", f".{fused}.")
                self.params[target][self._slice(fused, shard_id)].copy_(tensor)
                break
            else:
                target = name
                self.params[target].copy_(tensor)
            loaded.add(target)
        self.loads += 1
        return loaded

    def post_load(self) -> None:
        self.post_loads += 1

    def unfused(self) -> dict[str, torch.Tensor]:
        """The model's weights under HF names, for bit-exact comparison with the trainer's."""
        out = {}
        for name, _, _ in hf_specs():
            for fused, shard, shard_id in self.stacked_params_mapping:
                if f".{shard}." in name:
                    out[name] = self.params[name.replace(f".{shard}.", f".{fused}.")][self._slice(fused, shard_id)].clone()
                    break
            else:
                out[name] = self.params[name].clone()
        return out


class StandInActor(FSDPActorWeightSyncMixin, Worker):
    """The recipe's FSDP actor worker, reduced to what the sync touches: a gloo group over
    the actor ranks and parameters sharded as DTensors, so ``full_tensor()`` is a real
    collective and a rank that skipped the iteration would hang the others."""

    def __init__(self) -> None:
        super().__init__()
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        if not dist.is_initialized():
            dist.init_process_group("gloo", rank=self.rank, world_size=self.world_size)
        self.mesh = init_device_mesh("cpu", (self.world_size,))
        self.params: dict[str, Any] = {}
        if self.rank == 0:  # as get_actor_weights_info caches it
            self._weights_info = [(n, torch.Size(s), d) for n, s, d in hf_specs()]

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def set_version(self, version: int) -> None:
        """Hold the weights of ``version`` (the optimizer step, in a real trainer)."""
        from torch.distributed.tensor import Shard, distribute_tensor

        self.params = {n: distribute_tensor(t, self.mesh, [Shard(0)]) for n, t in hf_weights(version).items()}

    def _get_actor_params(self) -> dict[str, Any]:
        return self.params

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        return os.getpid()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def close(self) -> None:
        if self._ws_sender is not None:
            self._ws_sender.close()


class StandInRollout(RolloutWeightSyncMixin, Worker):
    """The recipe's rollout worker with a FusedModel in place of vLLM."""

    def __init__(self) -> None:
        super().__init__()
        self.model = FusedModel()

    def weightsync_target(self) -> VllmTarget:
        return VllmTarget(self.model, post_load=self.model.post_load, strict=True)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def weights(self) -> dict[str, Any]:
        return {"weights": self.model.unfused(), "loads": self.model.loads, "post_loads": self.model.post_loads}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def close(self) -> None:
        if self._ws_receiver is not None:
            self._ws_receiver.close()


# -- checkpoint-engine side (verl >= 0.8) ----------------------------------------------------


class EngineActor(Worker):
    """verl's actor worker as the checkpoint-engine manager sees it (same method names and
    dispatch as ``verl.workers.engine_workers.ActorRolloutRefWorker``)."""

    def __init__(self, checkpoint_engine_config: Any) -> None:
        super().__init__()
        self.use_engine(checkpoint_engine_config)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def use_engine(self, cfg: Any) -> None:
        """Build the engine as verl's actor worker does (lets a test reuse the processes)."""
        from verl.checkpoint_engine.base import CheckpointEngineRegistry
        from verl.utils.import_utils import import_external_libs

        import_external_libs(cfg.custom_backend_module or None)
        self.checkpoint_engine = CheckpointEngineRegistry.new(
            cfg.backend, is_master=self.rank == 0, bucket_size=cfg.update_weights_bucket_megabytes << 20,
            **cfg.engine_kwargs.get(cfg.backend, {}))
        self.iterated = 0

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def update_weights(self, global_steps: int | None = None, mode: str = "auto") -> Any:
        def weights():  # every rank walks it (in verl, producing a tensor is a collective)
            for name, tensor in hf_weights(global_steps).items():
                self.iterated += 1
                yield name, tensor

        return await self.checkpoint_engine.send_weights(weights(), global_steps=global_steps)

    @register(dispatch_mode=Dispatch.DP_COMPUTE, blocking=False)
    def execute_checkpoint_engine(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.checkpoint_engine, method)(*args, **kwargs)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def iterated_count(self) -> int:
        return self.iterated


class Collector:
    """Stands in for verl's vLLM server adapter: consumes ``receive_weights`` the way
    ``BaseRollout.update_weights`` does and keeps a copy of what arrived."""

    def __init__(self) -> None:
        self.received: dict[int | None, dict[str, torch.Tensor]] = {}

    async def update_weights(self, weights: Any, global_steps: int | None = None, **kwargs: Any) -> None:
        from verl.workers.rollout.utils import ensure_async_iterator

        got = self.received.setdefault(global_steps, {})
        async for name, tensor in ensure_async_iterator(weights):
            got[name] = tensor.clone()  # a vLLM adapter copies into its IPC bucket here


def engine_rollout_worker() -> type:
    """verl's own CheckpointEngineWorker with a Collector as server adapter (built lazily:
    importing verl.checkpoint_engine pulls in the rollout stack)."""
    from verl.checkpoint_engine.base import CheckpointEngineWorker

    class EngineRollout(CheckpointEngineWorker):
        def __init__(self, rollout_config: Any) -> None:
            super().__init__(rollout_config, None, server_adapter=Collector())

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def use_engine(self, cfg: Any) -> None:
            """Rebuild the engine the way CheckpointEngineWorker.__init__ does, from ``cfg``."""
            from verl.checkpoint_engine.base import CheckpointEngineRegistry

            self.checkpoint_engine = CheckpointEngineRegistry.new(
                cfg.backend, bucket_size=cfg.update_weights_bucket_megabytes << 20,
                **cfg.engine_kwargs.get(cfg.backend, {}))
            self.server_adapter.received.clear()

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def received(self, global_steps: int | None) -> dict[str, torch.Tensor]:
            return self.server_adapter.received.get(global_steps, {})

    return EngineRollout


class CpuGroups:
    """Makes verl RayWorkerGroups on CPU; ``close()`` kills their workers and placement groups."""

    def __init__(self) -> None:
        self.made: list = []

    def __call__(self, cls: type, n: int, **init: Any) -> Any:
        import ray
        from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

        pool = RayResourcePool(process_on_nodes=[n], use_gpu=False, max_colocate_count=1)
        wg = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(cls), **init),
                            device_name="cpu")
        self.made.append((wg, pool))
        return wg

    def close(self) -> None:
        import ray

        for wg, pool in self.made:
            for w in wg.workers:
                ray.kill(w)
            for pg in pool.pgs or []:
                ray.util.remove_placement_group(pg)
        self.made.clear()
