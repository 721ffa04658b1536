"""A vLLM model as a receiver's target: where the model sits inside a rollout worker (plain vLLM
or verl's), how received tensors reach it, and what runs once per version after the last bucket.

vLLM's ``model.load_weights(pairs)`` takes trainer (HF) names and maps them onto its own
parameters, fusing q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj``. The manifest
check therefore validates names through the model's ``packed_modules_mapping`` (the same
fusion, as a class attribute) instead of comparing names one to one.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from weightsync import Manifest
from weightsync.errors import ConfigError

# where the model sits in verl's rollout (``self.rollout``), newest verl first:
# - ``inference_engine`` is vLLM's WorkerWrapperBase, ``.worker`` vLLM 0.11's V1 Worker
#   (gpu_worker / vllm-ascend's NPUWorker), ``.model_runner.model`` its model: verl's
#   vllm_rollout at v0.6.1 - v0.7.0 / ccd7d934 and the recipe's sync_rollout_weights there
# - the sync LLM engine of verl v0.5 / v0.6 (``LLM(...)``, V0 engine)
# - a bare worker (tests, other integrations)
# - vLLM's Worker itself: verl 0.9.1's worker extension (vllm_rollout/utils.py) runs inside
#   the vLLM server's worker and reads ``self.model_runner.model``
MODEL_PATHS = (
    "inference_engine.worker.model_runner.model",
    "inference_engine.llm_engine.model_executor.driver_worker.worker.model_runner.model",
    "inference_engine.model_runner.model",
    "model_runner.model",
)
# verl's MoE expert-loader patch, newest verl first: verl.utils.vllm.patch from v0.6 on
# (ccd7d934, v0.7.0, 0.9.1), verl.utils.vllm_utils before (v0.5)
MOE_PATCHES = ("verl.utils.vllm.patch", "verl.utils.vllm_utils")
# names HF checkpoints carry that vLLM models skip on purpose
IGNORED = (re.compile(r"(^|\.)rotary_emb\.inv_freq$"), re.compile(r"(^|\.)rotary_emb\.(cos|sin)_cached$"))


def _walk(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def find_model(rollout: Any) -> tuple[Any, Any]:
    """(vLLM model, its model runner or worker) inside a verl rollout (``self.rollout``)."""
    tried = []
    for path in MODEL_PATHS:
        try:
            model = _walk(rollout, path)
        except AttributeError:
            tried.append(path)
            continue
        # vLLM wraps the model for CUDA / ACL graphs (CUDAGraphWrapper, vllm-ascend's
        # ACLGraphWrapper): the parameters, loader and mappings are the wrapped module's
        while not isinstance(model, torch.nn.Module) and hasattr(model, "runnable"):
            model = model.runnable
        return model, _walk(rollout, path.rsplit(".", 1)[0])
    raise RuntimeError(f"no vLLM model found in {type(rollout).__name__}; looked at self.rollout.{{{', '.join(tried)}}}")


def find_moe_patch() -> tuple[Callable[[Any], None] | None, list[str]]:
    """verl's ``patch_vllm_moe_model_weight_loader`` for the installed verl, and where it was
    looked for (for the error when there is none)."""
    tried = []
    for module in MOE_PATCHES:
        try:
            return importlib.import_module(module).patch_vllm_moe_model_weight_loader, tried
        except (ImportError, AttributeError) as exc:
            tried.append(f"{module}: {type(exc).__name__}: {exc}")
    return None, tried


def is_moe(model: Any) -> bool:
    """Whether the model holds vLLM fused experts (FusedMoE, or a platform's subclass)."""
    modules = model.modules() if hasattr(model, "modules") else ()
    return any(any(k.__name__ == "FusedMoE" for k in type(m).__mro__) for m in modules)


def vllm_post_load(model: Any, runner: Any) -> Callable[[], None] | None:
    """vLLM's ``process_weights_after_loading`` bound to this model, or None where vLLM lacks it."""
    try:
        from vllm.model_executor.model_loader.utils import process_weights_after_loading
    except ImportError:
        return None
    model_config = getattr(runner, "model_config", None) or runner.vllm_config.model_config
    device = getattr(runner, "device", None) or next(model.parameters()).device

    def post_load() -> None:
        # non-idempotent for some quantization methods, hence once per version, never per bucket
        process_weights_after_loading(model, model_config, device)

    return post_load


def fused_names(name: str, packed: Mapping[str, Iterable[str]]) -> str:
    """The parameter a trainer name lands in after vLLM's fusion (``q_proj`` -> ``qkv_proj``)."""
    for fused, parts in packed.items():
        for part in parts:
            token = f".{part}."
            if token in name:
                return name.replace(token, f".{fused}.")
    return name


def _tp_size() -> int:
    try:
        from vllm.distributed import get_tensor_model_parallel_world_size

        return get_tensor_model_parallel_world_size()
    except Exception:  # no vLLM, or its parallel state is not initialized (a stand-in model)
        return 1


def shape_problem(target: str, specs: list[Any], param: Any, tp: int) -> str | None:
    """Why the offered tensors cannot fill ``param``, or None. Fused parts concatenate along
    the parameter's ``output_dim``; a dim vLLM shards (``output_dim`` / ``input_dim``: TP
    ranks, vocabulary padding) may hold up to ``tp`` times the offer, every other dim must
    match exactly."""
    shape = tuple(param.shape)
    out_dim, in_dim = getattr(param, "output_dim", None), getattr(param, "input_dim", None)
    cat = 0 if out_dim is None else out_dim
    offered = list(specs[0].shape)
    for spec in specs[1:]:
        if len(spec.shape) == len(offered) and len(offered) > cat:
            offered[cat] += spec.shape[cat]
    ok = len(offered) == len(shape) and all(
        o <= n * tp if d in (out_dim, in_dim) else o == n for d, (o, n) in enumerate(zip(offered, shape)))
    if ok:
        return None
    names = ", ".join(f"{s.name!r} ({s.describe()})" for s in specs)
    return f"tensor {names} does not fit parameter {target!r} of shape {list(shape)} in the rollout model"


def checkpoint_params(model: Any) -> dict[str, Any]:
    """The model's parameters as its loader fills them. After loading, a platform may
    replace a weight by a packed copy and leave an empty parameter behind (vLLM >= 0.32 on
    x86 CPUs: oneDNN); vLLM's layerwise reload keeps the loading layout as meta tensors,
    which are used where they exist."""
    params = dict(model.named_parameters())
    try:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    except ImportError:
        return params
    for prefix, module in model.named_modules():
        info = LAYERWISE_INFO.get(module)
        for name, meta in (info.restore_metadata[0] if info is not None else {}).items():
            params[f"{prefix}.{name}" if prefix else name] = meta
    return params


def layerwise_reload(runner: Any) -> Callable[[list], None] | None:
    """The engine's own in-place reload (``model_runner.reload_weights``, vLLM's layerwise
    reload), or None where vLLM has none. Where it exists vLLM may repack weights after
    loading (oneDNN on CPU, quantized kernels), so a second direct ``load_weights`` would
    write into parameters the kernels no longer read, or fail halfway."""
    try:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import layerwise  # noqa: F401
    except ImportError:
        return None
    reload = getattr(runner, "reload_weights", None)
    if reload is None:
        return None

    def run(pairs: list) -> None:
        with set_current_vllm_config(runner.vllm_config):
            reload(weights_iterator=iter(pairs), is_checkpoint_format=True)

    return run


def fused_check(model: Any, strict: bool = False) -> Callable[[Manifest], list[str]] | None:
    """The manifest check for a vLLM-style model: every offered tensor must land in one of
    the model's parameters through ``packed_modules_mapping``, with a shape that fits it;
    with ``strict`` every parameter must also be fed. None for models that rename further
    (``hf_to_vllm_mapper``), where only the model's own loader knows the mapping."""
    if getattr(model, "hf_to_vllm_mapper", None) is not None or not hasattr(model, "named_parameters"):
        return None
    packed = dict(getattr(model, "packed_modules_mapping", None) or {})
    params = checkpoint_params(model)

    def check(manifest: Manifest) -> list[str]:
        problems: list[str] = []
        fed: dict[str, list[Any]] = {}
        for spec in manifest:
            if any(p.search(spec.name) for p in IGNORED):
                continue
            target = fused_names(spec.name, packed)
            if target in params:
                fed.setdefault(target, []).append(spec)
            elif spec.name == "lm_head.weight" and "lm_head.weight" not in params:
                continue  # tied embeddings: vLLM shares embed_tokens and skips lm_head
            else:
                problems.append(f"unknown tensor {spec.name!r} ({spec.describe()}): the rollout model has no "
                                f"parameter {target!r}")
        tp = _tp_size()
        problems += [why for t, specs in fed.items() if (why := shape_problem(t, specs, params[t], tp))]
        if strict:
            problems += [f"parameter {p!r} of the rollout model is fed by no offered tensor" for p in sorted(set(params) - set(fed))]
        return problems

    return check


class VllmTarget:
    """What a WeightReceiver needs from a vLLM engine (pass the target itself as the
    receiver's ``load_weights``): load, post-load, the prefix-cache reset, manifest check.

    Two ways to load, chosen by the installed vLLM: where it has its layerwise reload
    (``reload``), the buckets of a version are copied aside and handed to the engine's own
    ``reload_weights`` at post-load, so a version that fails while arriving never touched
    the model; else each bucket goes straight to ``model.load_weights`` and vLLM's
    ``process_weights_after_loading`` runs at post-load (vLLM 0.11)."""

    def __init__(self, model: Any, post_load: Callable[[], None] | None = None, strict: bool = False,
                 reset_cache: Callable[[], Any] | None = None, reload: Callable[[list], None] | None = None):
        self.model = model
        self._post_load = post_load
        self._reset_cache = reset_cache
        self._reload = reload
        self._staged: list[tuple[str, torch.Tensor]] = []
        self.expected = fused_check(model, strict=strict)

    @classmethod
    def from_rollout(cls, rollout: Any) -> VllmTarget:
        """Bind to the vLLM model of a verl rollout; call it at the first sync (in the recipe
        from ccd7d934 on, the sync group exists before vLLM starts). A MoE model needs verl's
        expert-loader patch before a direct ``load_weights`` (as the recipe applies it);
        without one the experts would not load, so that is an error here. Where the rollout
        holds an offline ``LLM`` (``inference_engine``), its prefix cache is reset with each
        version; an async server's is reset by whoever drives the server."""
        model, runner = find_model(rollout)
        patch, tried = find_moe_patch()
        if patch is not None:
            patch(model)
        elif is_moe(model):
            raise ConfigError(f"{type(model).__name__} is a MoE model and needs verl's "
                              f"patch_vllm_moe_model_weight_loader before weights are loaded into it, "
                              f"but none was found: {'; '.join(tried)}")
        reset = getattr(getattr(rollout, "inference_engine", None), "reset_prefix_cache", None)
        reload = layerwise_reload(runner)
        return cls(model, None if reload is not None else vllm_post_load(model, runner),
                   reset_cache=reset if callable(reset) else None, reload=reload)

    @classmethod
    def from_llm(cls, llm: Any) -> VllmTarget:
        """Bind to vLLM's offline ``LLM`` whose engine runs in this process
        (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, one worker): the model is at
        ``llm.llm_engine.model_executor.driver_worker.worker.model_runner.model``."""
        executor = getattr(llm.llm_engine, "model_executor", None)
        if executor is None or not hasattr(executor, "driver_worker"):
            raise ConfigError("the LLM's engine core runs in another process; start it with "
                              "VLLM_ENABLE_V1_MULTIPROCESSING=0 (and one worker) to load weights into it here")
        return cls.from_rollout(_Holder(llm))

    @torch.no_grad()
    def load_weights(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> Any:
        if self._reload is None:
            return self.model.load_weights(pairs)
        # the pairs are views of transport buffers, reused by the next bucket
        self._staged.extend((n, t.clone()) for n, t in pairs)
        return None

    def post_load(self) -> None:
        if self._reload is not None:
            staged, self._staged = self._staged, []
            self._reload(staged)
        elif self._post_load is not None:
            self._post_load()

    def abort_load(self) -> None:
        self._staged = []

    @property
    def reset_cache(self) -> Callable[[], Any] | None:
        return self._reset_cache


class _Holder:
    """Where verl's sync-mode rollout keeps an ``LLM``: ``inference_engine``."""

    def __init__(self, llm: Any):
        self.inference_engine = llm
