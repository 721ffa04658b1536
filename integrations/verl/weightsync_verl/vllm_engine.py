"""Rollout-side glue: where the vLLM model sits inside a verl rollout worker, how received
tensors reach it, and what runs once per version after the last bucket.

vLLM's ``model.load_weights(pairs)`` takes trainer (HF) names and maps them onto its own
parameters, fusing q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj``. The manifest
check therefore validates names through the model's ``packed_modules_mapping`` (the same
fusion, as a class attribute) instead of comparing names one to one.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from weightsync import Manifest

# where the model sits, newest verl first (async server worker, then the sync LLM engine)
MODEL_PATHS = (
    "inference_engine.worker.model_runner.model",
    "inference_engine.llm_engine.model_executor.driver_worker.worker.model_runner.model",
    "inference_engine.model_runner.model",
)
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
        return model, _walk(rollout, path.rsplit(".", 1)[0])
    raise RuntimeError(f"no vLLM model found in {type(rollout).__name__}; looked at self.rollout.{{{', '.join(tried)}}}")


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


def fused_check(model: Any, strict: bool = False) -> Callable[[Manifest], list[str]] | None:
    """The manifest check for a vLLM-style model: every offered tensor must land in one of
    the model's parameters through ``packed_modules_mapping``; with ``strict`` every
    parameter must also be fed. None for models that rename further (``hf_to_vllm_mapper``),
    where only the model's own loader knows the mapping."""
    if getattr(model, "hf_to_vllm_mapper", None) is not None or not hasattr(model, "named_parameters"):
        return None
    packed = dict(getattr(model, "packed_modules_mapping", None) or {})
    params = {name for name, _ in model.named_parameters()}

    def check(manifest: Manifest) -> list[str]:
        problems, fed = [], set()
        for spec in manifest:
            if any(p.search(spec.name) for p in IGNORED):
                continue
            target = fused_names(spec.name, packed)
            if target in params:
                fed.add(target)
            elif spec.name == "lm_head.weight" and "lm_head.weight" not in params:
                continue  # tied embeddings: vLLM shares embed_tokens and skips lm_head
            else:
                problems.append(f"unknown tensor {spec.name!r} ({spec.describe()}): the rollout model has no "
                                f"parameter {target!r}")
        if strict:
            problems += [f"parameter {p!r} of the rollout model is fed by no offered tensor" for p in sorted(params - fed)]
        return problems

    return check


class VllmTarget:
    """What a WeightReceiver needs from a vLLM model: load, post-load, manifest check."""

    def __init__(self, model: Any, post_load: Callable[[], None] | None = None, strict: bool = False):
        self.model = model
        self._post_load = post_load
        self.expected = fused_check(model, strict=strict)

    @classmethod
    def from_rollout(cls, rollout: Any) -> VllmTarget:
        model, runner = find_model(rollout)
        try:  # MoE experts need verl's loader patch before a direct load_weights (as the recipe does)
            from verl.utils.vllm_utils import patch_vllm_moe_model_weight_loader

            patch_vllm_moe_model_weight_loader(model)
        except ImportError:
            pass
        return cls(model, vllm_post_load(model, runner))

    @torch.no_grad()
    def load_weights(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> Any:
        return self.model.load_weights(pairs)

    def post_load(self) -> None:
        if self._post_load is not None:
            self._post_load()
