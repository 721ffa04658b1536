"""CPU subclasses of the recipe's REAL worker classes (imported from a verl source tree),
differing from them only where CPU forces it:

- torch.cpu gets the RNG-state and empty_cache functions verl calls on the device namespace;
- the process group: the recipe's ``ActorRolloutRefWorker.__init__`` asks for
  ``cpu:gloo,<device>:<nccl|hccl>``; here a plain gloo group is made first (the real
  ``__init__`` then skips its own, as it does whenever one exists);
- the rollout engine: vLLM cannot run here, so verl's rollout registry maps ``vllm`` to
  :class:`CpuVllmAsyncRollout` (async, ccd7d934 / v0.7.0) or :class:`CpuVllmRollout`
  (sync, v0.6.1); v0.5.0 / v0.5.0-80 have no registry, their ``RolloutWorker.init_model``
  imports ``vLLMRollout`` from ``verl.workers.rollout.vllm_rollout`` when it runs, so that
  name is :class:`CpuVllmRolloutV05` there (v0.5's constructor, ``(model_path, config,
  tokenizer, model_hf_config, **kwargs)``). They mirror ``vLLMAsyncRollout`` / ``vLLMRollout`` of those trees as far
  as the sync touches them: the async one has ``inference_engine = None`` until the vLLM
  server's ``init_worker`` / ``load_model`` (``start_engine`` here, called where the
  trainer's ``_init_async_rollout_manager`` would start the servers); the sync one builds
  its engine in ``__init__``. The model sits where the recipe's own sync reads it, and is a
  FusedModel (vLLM's fused qkv / gate_up loading) built from the HF config, in the
  rollout's ``dtype``.

Everything else (init_model, FSDP2 model building, weights info, dispatch) is verl's code.
Shipped to Ray workers by value (tests/ is not importable there).
"""

from __future__ import annotations

import os
import sys
import types
from types import SimpleNamespace
from typing import Any

import torch
from verl.single_controller.base.decorator import Dispatch, register
from weightsync_verl.testing import FusedModel

REGISTRY_MODULE = "weightsync_cpu_rollout"


def model_specs(model_path: str, dtype: Any) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(HF name, shape, dtype) of the model at ``model_path``, as vLLM would hold it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    return [(n, tuple(p.shape), dtype) for n, p in model.state_dict().items()]


def _engine(model: FusedModel, sync: bool) -> Any:
    # vLLM's model runner: the model, and the model_config / device that vLLM's
    # process_weights_after_loading takes (weightsync runs it once per version)
    worker = SimpleNamespace(model_runner=SimpleNamespace(model=model, model_config=SimpleNamespace(),
                                                          device=torch.device("cpu")))
    if sync:  # vLLM's offline LLM: inference_engine.llm_engine.model_executor.driver_worker.worker,
        # and the calls v0.6.1's VLLMShardingManager makes on it (LLM.wake_up / sleep / reset_prefix_cache)
        return SimpleNamespace(llm_engine=SimpleNamespace(model_executor=SimpleNamespace(
            driver_worker=SimpleNamespace(worker=worker))), reset_prefix_cache=lambda: None,
            wake_up=lambda tags=None: None, sleep=lambda level=1: None)
    return SimpleNamespace(worker=worker)  # vLLM's WorkerWrapperBase


class CpuVllmAsyncRollout:
    """vLLMAsyncRollout as the sync sees it: no engine until the server starts it."""

    def __init__(self, config: Any, model_config: Any, device_mesh: Any = None):
        self.config, self.model_config, self.device_mesh = config, model_config, device_mesh
        self.inference_engine: Any = None

    def start_engine(self) -> None:
        model = FusedModel(model_specs(self.model_config.local_path, self.config.dtype))
        self.inference_engine = _engine(model, sync=False)

    def model(self) -> FusedModel:
        return self.inference_engine.worker.model_runner.model


class CpuVllmRollout(CpuVllmAsyncRollout):
    """vLLMRollout (v0.6.1, rollout.mode=sync): the LLM engine exists from __init__ on."""

    def __init__(self, config: Any, model_config: Any, device_mesh: Any = None):
        super().__init__(config, model_config, device_mesh)
        model = FusedModel(model_specs(model_config.local_path, config.dtype))
        self.inference_engine = _engine(model, sync=True)

    def start_engine(self) -> None:
        pass

    def model(self) -> FusedModel:
        return self.inference_engine.llm_engine.model_executor.driver_worker.worker.model_runner.model


class CpuVllmRolloutV05(CpuVllmRollout):
    """v0.5.0's vLLMRollout: the same engine, v0.5's constructor."""

    def __init__(self, model_path: str, config: Any, tokenizer: Any, model_hf_config: Any, **kwargs: Any):
        super().__init__(config, SimpleNamespace(local_path=model_path), kwargs.get("device_mesh"))


def _v05_cpu_rollout() -> None:
    from verl.workers.rollout import base

    if not hasattr(base, "_ROLLOUT_REGISTRY"):  # v0.5.0, v0.5.0-80
        from verl.workers.rollout import vllm_rollout

        vllm_rollout.vLLMRollout = CpuVllmRolloutV05


def _torch_cpu_device_api() -> None:
    """verl calls the device namespace (``get_torch_device()`` = ``torch.cpu`` here) for RNG
    state, cache release and (v0.5.0's log_gpu_memory_usage, on every model build) memory
    figures; torch.cpu lacks them: the host RNG is torch's global one, the host has no cache
    to release and no allocator statistics (0), its memory is the machine's."""
    import psutil

    def host_memory() -> tuple[int, int]:
        vm = psutil.virtual_memory()
        return vm.available, vm.total

    for name, fn in (("get_rng_state", torch.get_rng_state), ("set_rng_state", torch.set_rng_state),
                     ("manual_seed", torch.manual_seed), ("empty_cache", lambda: None),
                     ("memory_allocated", lambda device=None: 0), ("memory_reserved", lambda device=None: 0),
                     ("max_memory_allocated", lambda device=None: 0), ("max_memory_reserved", lambda device=None: 0),
                     ("mem_get_info", lambda device=None: host_memory())):
        if not hasattr(torch.cpu, name):
            setattr(torch.cpu, name, fn)


def _gloo_and_cpu_rollouts() -> None:
    import torch.distributed as dist
    from verl.workers.rollout import base

    _torch_cpu_device_api()

    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    module = sys.modules.get(REGISTRY_MODULE) or types.ModuleType(REGISTRY_MODULE)
    module.CpuVllmAsyncRollout, module.CpuVllmRollout = CpuVllmAsyncRollout, CpuVllmRollout
    sys.modules[REGISTRY_MODULE] = module
    if hasattr(base, "_ROLLOUT_REGISTRY"):
        base._ROLLOUT_REGISTRY[("vllm", "async")] = f"{REGISTRY_MODULE}.CpuVllmAsyncRollout"
        base._ROLLOUT_REGISTRY[("vllm", "sync")] = f"{REGISTRY_MODULE}.CpuVllmRollout"


class _Cpu:
    def __init__(self, config: Any, role: str):
        _gloo_and_cpu_rollouts()
        super().__init__(config, role)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def close_weightsync(self) -> None:
        for party in (getattr(self, "_ws_sender", None), getattr(self, "_ws_receiver", None)):
            if party is not None:
                party.close()


class _CpuActor(_Cpu):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def train_step(self, seed: int) -> None:
        """A real optimizer step on verl's FSDP2 module and optimizer (random tokens, LM loss):
        every parameter changes between versions."""
        from verl.utils.fsdp_utils import load_fsdp_model_to_gpu, offload_fsdp_model_to_cpu

        offload = getattr(self, "_is_offload_param", False)
        if offload:
            load_fsdp_model_to_gpu(self.actor_module_fsdp)
        g = torch.Generator().manual_seed(seed)
        vocab = self.actor_model_config.vocab_size
        ids = torch.randint(0, vocab, (2, 8), generator=g)
        out = self.actor_module_fsdp(input_ids=ids, labels=ids, use_cache=False)
        self.actor_optimizer.zero_grad()
        out.loss.backward()
        self.actor_optimizer.step()
        if offload:
            offload_fsdp_model_to_cpu(self.actor_module_fsdp)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def full_weights(self) -> dict[str, torch.Tensor] | None:
        """The trainer's weights as the recipe's sync reads them (``_get_actor_params``),
        gathered whole; every rank walks them (collectives), rank 0 returns them."""
        out = {}
        for name, tensor in self._get_actor_params().items():
            tensor = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
            out[name] = tensor.detach().to("cpu").clone()
        return out if self.rank == 0 else None


class _CpuRollout(_Cpu):
    def __init__(self, config: Any, role: str):
        _v05_cpu_rollout()  # here only: it imports vLLM, which the actor ranks need not
        super().__init__(config, role)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def start_engine(self) -> None:
        self.rollout.start_engine()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def engine_weights(self) -> dict[str, Any]:
        model = self.rollout.model()
        return {"weights": model.unfused(), "loads": model.loads}


def cpu_classes(actor_cls: type, rollout_cls: type) -> tuple[type, type]:
    """CPU subclasses of the recipe's (patched) actor and rollout worker classes."""
    actor = type(f"Cpu{actor_cls.__name__}", (_CpuActor, actor_cls), {"__module__": __name__})
    rollout = type(f"Cpu{rollout_cls.__name__}", (_CpuRollout, rollout_cls), {"__module__": __name__})
    return actor, rollout
