"""Stand-ins for verl's workers and a vLLM model, used by the tests (they must be importable
in Ray worker processes, hence a module of the package). Real weightsync parties, real verl
worker groups and dispatch; only the models are tiny."""

from __future__ import annotations

import os
from collections.abc import Iterable
from types import SimpleNamespace
from typing import Any

import torch
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register

from .workers import FSDPActorWeightSyncMixin, RolloutWeightSyncMixin

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


CHANGED = 0.01  # of the bytes a version rewrites: an RL step changes a few percent of the elements


def hf_weights(version: int) -> dict[str, torch.Tensor]:
    """The trainer's weights at ``version``: random bits (NaN payloads and -0.0 included), one
    base for every version with ``CHANGED`` of each tensor's bytes, chosen and drawn by the
    version, rewritten: two versions differ in about 2 % of their bytes, as two RL steps do in a
    few percent of their elements, so a delta between them is sparse."""
    base, g = torch.Generator().manual_seed(1000), torch.Generator().manual_seed(2000 + version)
    out = {}
    for name, shape, dtype in hf_specs():
        n = torch.Size(shape).numel() * dtype.itemsize
        raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=base)
        at = torch.randint(0, n, (max(1, int(n * CHANGED)),), generator=g)
        raw[at] = torch.randint(0, 256, (at.numel(),), dtype=torch.uint8, generator=g)
        out[name] = raw.view(dtype).reshape(shape)
    return out


class FusedModel:
    """vLLM-style model: q/k/v fused into ``qkv_proj``, gate/up into ``gate_up_proj``;
    ``load_weights`` maps HF names through a stacked-params table and loads each shard into
    its slice, as vLLM's Qwen2 loader does (vllm 0.11.0 ``Qwen2Model.load_weights``).
    ``specs`` [(HF name, shape, dtype)] gives the trainer's layout (default: hf_specs())."""

    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    stacked_params_mapping = [  # (fused param, HF shard, shard id)
        ("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1),
    ]

    def __init__(self, specs: Iterable[tuple[str, Any, torch.dtype]] | None = None) -> None:
        self.specs = [(n, tuple(s), d) for n, s, d in (hf_specs() if specs is None else specs)]
        self.params: dict[str, torch.Tensor] = {}
        self.slices: dict[str, slice] = {}  # HF name -> rows of its fused parameter
        fused_shapes: dict[str, tuple[list[int], Any, torch.dtype]] = {}
        for name, shape, dtype in self.specs:
            target = self._fused(name)
            if target == name:
                self.params[name] = torch.zeros(shape, dtype=dtype)
                continue
            rows, rest, _ = fused_shapes.setdefault(target, ([0], shape[1:], dtype))
            self.slices[name] = slice(rows[0], rows[0] + shape[0])
            rows[0] += shape[0]
        for target, (rows, rest, dtype) in fused_shapes.items():
            self.params[target] = torch.zeros((rows[0], *rest), dtype=dtype)
        self.loads = self.post_loads = 0
        # vLLM's *ForCausalLM keep their decoder stack under .model; verl's MoE loader patch
        # (verl.utils.vllm.patch, called on every rollout model) refuses a model without it
        self.model = SimpleNamespace(layers=[])

    def _fused(self, name: str) -> str:
        for fused, shard, _ in self.stacked_params_mapping:
            if f".{shard}." in name:
                return name.replace(f".{shard}.", f".{fused}.")
        return name

    def named_parameters(self) -> Iterable[tuple[str, torch.Tensor]]:
        return iter(self.params.items())

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = set()
        for name, tensor in weights:
            target = self._fused(name)
            dest = self.params[target]
            (dest[self.slices[name]] if name in self.slices else dest).copy_(tensor)
            loaded.add(target)
        self.loads += 1
        return loaded

    def post_load(self) -> None:
        self.post_loads += 1

    def named_modules(self) -> Iterable[tuple[str, Any]]:
        """torch.nn.Module's walk, which vLLM's process_weights_after_loading makes: this model
        has no submodules, and nothing on it to process after loading."""
        return iter([("", self)])

    def unfused(self) -> dict[str, torch.Tensor]:
        """The model's weights under HF names, for bit-exact comparison with the trainer's."""
        out = {}
        for name, _, _ in self.specs:
            dest = self.params[self._fused(name)]
            out[name] = (dest[self.slices[name]] if name in self.slices else dest).clone()
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
    def init_model(self) -> None:
        """The real one builds the FSDP model; here set_version provides the weights."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def set_version(self, version: int) -> None:
        """Hold the weights of ``version`` (the optimizer step, in a real trainer)."""
        from torch.distributed.tensor import Shard, distribute_tensor

        self.params = {n: distribute_tensor(t, self.mesh, [Shard(0)]) for n, t in hf_weights(version).items()}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def update_actor(self, version: int) -> None:
        """The recipe's update_actor, as far as the sync sees it: new weights (``version``'s)."""
        self.set_version(version)

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
    """The recipe's rollout worker, in the order and strictness of the real one
    (``DetachAsyncRolloutWorker`` at verl v0.5.0-716-gccd7d934 / v0.7.0):

    - built with ``(config=actor_rollout_ref, role="rollout")``; ``init_model`` turns
      ``config.rollout`` into verl's ``RolloutConfig`` dataclass (``omega_conf_to_dataclass``,
      which refuses unknown keys) and builds a rollout whose ``inference_engine`` is None,
      as ``vLLMAsyncRollout.__init__`` leaves it;
    - the engine appears only in ``start_engine``, which does what vLLM's server does through
      ``vLLMAsyncRollout._init_worker`` / ``_load_model`` when the trainer's
      ``_init_async_rollout_manager`` starts it, i.e. after ``_create_weight_sync_group``;
    - the model sits at ``self.rollout.inference_engine.worker.model_runner.model``, as the
      recipe's own ``sync_rollout_weights`` reads it; a FusedModel stands in for vLLM's model.
    """

    def __init__(self, config: Any, role: str) -> None:
        super().__init__()
        assert role == "rollout"
        self.config = config
        self.rollout: Any = None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        from verl.utils.config import omega_conf_to_dataclass
        from verl.workers.config import RolloutConfig

        rollout_config = omega_conf_to_dataclass(self.config.rollout, dataclass_type=RolloutConfig)
        self.rollout = SimpleNamespace(config=rollout_config, inference_engine=None)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def start_engine(self) -> None:
        model = FusedModel()
        self.rollout.inference_engine = SimpleNamespace(worker=SimpleNamespace(model_runner=SimpleNamespace(model=model)))

    def _model(self) -> FusedModel:
        return self.rollout.inference_engine.worker.model_runner.model

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def weights(self) -> dict[str, Any]:
        model = self._model()
        return {"weights": model.unfused(), "loads": model.loads}

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

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        """The real one builds the model engine; here update_weights produces the weights."""

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


class ReplicaGates:
    """What verl's CheckpointEngineManager (0.9.1) calls on a ``RolloutReplica`` around a sync:
    its ``workers`` and the request / KV-cache gates, which a vLLM server would act on."""

    def __init__(self, workers: list) -> None:
        self.workers = workers
        self.calls: list[str] = []

    async def abort_all_requests(self, reject_request: bool = False) -> None:
        self.calls.append("abort")

    async def release_kv_cache(self) -> None:
        self.calls.append("release")

    async def resume_kv_cache(self) -> None:
        self.calls.append("resume_kv")

    async def resume_generation(self) -> None:
        self.calls.append("resume")


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
