"""Internal. Built-in model layouts: (name, dtype, shape) lists shaped like real models, so the
benchmark and the tests need no download."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from weightsync.manifest import Manifest, TensorSpec, dtype_name


def _dense(vocab: int, hidden: int, inter: int, layers: int, heads: int, kv_heads: int,
           head_dim: int, qkv_bias: bool, qk_norm: bool, tied: bool, dtype: str) -> list[TensorSpec]:
    specs = [TensorSpec("model.embed_tokens.weight", dtype, (vocab, hidden))]
    q, kv = heads * head_dim, kv_heads * head_dim
    for i in range(layers):
        p = f"model.layers.{i}."
        specs += [TensorSpec(p + "input_layernorm.weight", dtype, (hidden,))]
        for proj, out in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            specs.append(TensorSpec(f"{p}self_attn.{proj}.weight", dtype, (out, hidden)))
            if qkv_bias:
                specs.append(TensorSpec(f"{p}self_attn.{proj}.bias", dtype, (out,)))
        if qk_norm:
            specs += [TensorSpec(p + "self_attn.q_norm.weight", dtype, (head_dim,)),
                      TensorSpec(p + "self_attn.k_norm.weight", dtype, (head_dim,))]
        specs += [
            TensorSpec(p + "self_attn.o_proj.weight", dtype, (hidden, q)),
            TensorSpec(p + "post_attention_layernorm.weight", dtype, (hidden,)),
            TensorSpec(p + "mlp.gate_proj.weight", dtype, (inter, hidden)),
            TensorSpec(p + "mlp.up_proj.weight", dtype, (inter, hidden)),
            TensorSpec(p + "mlp.down_proj.weight", dtype, (hidden, inter)),
        ]
    specs.append(TensorSpec("model.norm.weight", dtype, (hidden,)))
    if not tied:
        specs.append(TensorSpec("lm_head.weight", dtype, (vocab, hidden)))
    return specs


def _moe(layers: int, experts: int, hidden: int, expert_inter: int, dtype: str) -> list[TensorSpec]:
    """Many small tensors, like a fine-grained MoE: the case per-tensor broadcast handles worst."""
    specs = [TensorSpec("model.embed_tokens.weight", dtype, (32000, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        specs += [TensorSpec(p + "self_attn.qkv_proj.weight", dtype, (3 * hidden, hidden)),
                  TensorSpec(p + "self_attn.o_proj.weight", dtype, (hidden, hidden)),
                  TensorSpec(p + "mlp.gate.weight", dtype, (experts, hidden))]
        for e in range(experts):
            for proj, shape in (("gate_proj", (expert_inter, hidden)), ("up_proj", (expert_inter, hidden)),
                                ("down_proj", (hidden, expert_inter))):
                specs.append(TensorSpec(f"{p}mlp.experts.{e}.{proj}.weight", dtype, shape))
    specs.append(TensorSpec("lm_head.weight", dtype, (32000, hidden)))
    return specs


# elements a fixed-cost layout keeps of each tensor: 2 KiB in bf16, so bytes cost next to nothing
FIXED_COST_ELEMS = 1024


def fixed_cost(specs: Iterable[TensorSpec], elems: int = FIXED_COST_ELEMS) -> list[TensorSpec]:
    """The same tensors (names, order, dtypes), each cut to one dimension of at most ``elems``
    elements: a version of it costs what a version costs beyond its bytes (per-tensor host work,
    coordinator round trips), the bench's fixed-cost rows. 1-D because what a version costs per
    tensor (a name, a spec, a copy call) does not depend on its rank."""
    return [TensorSpec(s.name, s.dtype, (min(s.numel, elems),)) for s in specs]


LAYOUTS: dict[str, Callable[[str], list[TensorSpec]]] = {
    # Qwen2.5-0.5B with an untied head: two embedding-size tensors and many small ones, ~1.2 GB in bf16
    "qwen2.5-0.5b": lambda dt: _dense(151936, 896, 4864, 24, 14, 2, 64, True, False, False, dt),
    # the growth curve: the same family at 3.1 GB and 6.2 GB in bf16 (tied embeddings, as released)
    "qwen2.5-1.5b": lambda dt: _dense(151936, 1536, 8960, 28, 12, 2, 128, True, False, True, dt),
    "qwen2.5-3b": lambda dt: _dense(151936, 2048, 11008, 36, 16, 2, 128, True, False, True, dt),
    "qwen3-8b": lambda dt: _dense(151936, 4096, 12288, 36, 32, 8, 128, False, True, False, dt),
    # ~2,300 tensors, ~0.5 GB in bf16
    "moe-small": lambda dt: _moe(12, 64, 512, 128, dt),
    # qwen2.5-0.5b's 291 tensors at <= 1024 elements each (0.47 MiB in bf16): the fixed cost of a version
    "qwen2.5-0.5b-fixed": lambda dt: fixed_cost(LAYOUTS["qwen2.5-0.5b"](dt)),
    # 8 tensors of 16 MiB in bf16 (128 MiB): the layout of the multi-host bench (--hosts), whose
    # rows are set by the link, so a small one runs in minutes
    "link-128m": lambda dt: [TensorSpec(f"layers.{i}.mlp.weight", dt, (4096, 2048)) for i in range(8)],
    # a few MiB, for tests
    "tiny": lambda dt: _dense(1000, 64, 128, 2, 4, 2, 16, True, False, False, dt),
    # 4 MiB in bf16, first dims that 2, 3 and 4 ranks split unevenly (one with fewer rows than
    # ranks) and a 0-dim tensor: sharded sending's edge cases, for tests
    "tiny-uneven": lambda dt: [TensorSpec("embed.weight", dt, (4001, 256)), TensorSpec("layers.0.q.weight", dt, (97, 256)),
                               TensorSpec("layers.0.k.weight", dt, (3, 256)), TensorSpec("layers.0.norm.weight", dt, (255,)),
                               TensorSpec("layers.0.scale", dt, ()), TensorSpec("lm_head.weight", dt, (4001, 256))],
}


def layout(name: str, dtype: torch.dtype | str = torch.bfloat16) -> Manifest:
    if name not in LAYOUTS:
        raise KeyError(f"unknown layout {name!r}; built-in: {', '.join(sorted(LAYOUTS))}")
    dt = dtype if isinstance(dtype, str) else dtype_name(dtype)
    return Manifest(tuple(LAYOUTS[name](dt)))


def materialize(manifest: Manifest, seed: int = 0, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Tensors for a manifest, filled with seeded random bits (every bit pattern may occur)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for spec in manifest:
        raw = torch.randint(0, 256, (spec.nbytes,), dtype=torch.uint8, generator=gen)
        if spec.dtype == "bool":
            raw &= 1  # only 0/1 are valid bool bytes
        out[spec.name] = raw.view(spec.torch_dtype).view(spec.shape).to(device)
    return out
