"""Internal. What one training step does to the weights a trainer sends: ``weightsync bench --update``.

``random``: every byte of every tensor changes each version (the worst case for a delta; what
a full sync moves anyway). ``adamw-1e-6`` / ``adamw-1e-5``: the step of an RL trainer. Each
tensor gets an fp32 master, initialised like a transformer (normal, std 0.02; norm weights
1.0), stepped by ``torch.optim.AdamW`` (betas 0.9 / 0.999, eps 1e-8, weight_decay 0.01) with
gradients ``sqrt(signal) * mu + sqrt(1 - signal) * noise_t``: ``mu`` drawn once per element
(the direction a run keeps following), ``noise_t`` fresh each step, both normal at a scale that
makes the whole model's gradient norm 1.0 (verl clips to 1.0). The bf16 copy is the master
rounded to nearest; an element changes when its master crosses a rounding step.

Adam's first steps move every element by about lr (its bias correction), so a few warm-up
steps run before the counted ones. AdamW is elementwise: stepping a tensor in chunks of
``chunk_elems`` with its own optimizer per chunk gives the same numbers as stepping the whole
model at once, and keeps the peak near one chunk's state (master, two moments, gradient,
mu: 20 bytes per element) however large the model is.

Pure: torch only, no Ray, no timing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import resource
import sys
from collections.abc import Iterator
from typing import Any

import torch

from weightsync.manifest import Manifest, TensorSpec

UPDATES = ("random", "adamw-1e-6", "adamw-1e-5")
BLOCKS = (64, 4096)  # granularities a delta could work at: a cache line, a page
_STATE_BYTES_PER_ELEM = 20  # fp32 master, exp_avg, exp_avg_sq, grad, mu


@dataclasses.dataclass(frozen=True)
class AdamWUpdate:
    lr: float
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    warmup_steps: int = 10
    steps: int = 2  # counted steady-state steps; the last one is the pair a bench alternates
    signal: float = 0.5  # share of the gradient variance that is the same every step
    grad_norm: float = 1.0
    init_std: float = 0.02
    seed: int = 0
    chunk_elems: int = 1 << 24

    @property
    def name(self) -> str:
        return f"adamw-{self.lr:g}"

    def describe(self) -> dict[str, Any]:
        return {"model": self.name, "optimizer": "torch.optim.AdamW", **dataclasses.asdict(self),
                "init": f"normal(0, {self.init_std}); *norm* weights 1.0",
                "grads": "sqrt(signal)*mu + sqrt(1-signal)*noise_t, normal, whole-model norm grad_norm"}


def parse(name: str, **overrides: Any) -> AdamWUpdate | None:
    """``random`` -> None; ``adamw-<lr>`` -> the model at that learning rate."""
    if name == "random":
        return None
    if not name.startswith("adamw-"):
        raise ValueError(f"unknown update model {name!r}: one of {', '.join(UPDATES)}")
    return AdamWUpdate(lr=float(name.removeprefix("adamw-")), **overrides)


def _float_specs(manifest: Manifest) -> list[TensorSpec]:
    return [s for s in manifest if s.torch_dtype.is_floating_point and s.numel]


def _init(spec: TensorSpec, n: int, gen: torch.Generator, std: float) -> torch.Tensor:
    if "norm" in spec.name:
        return torch.ones(n, dtype=torch.float32)
    return torch.randn(n, generator=gen, dtype=torch.float32) * std


def _counts(old: torch.Tensor, new: torch.Tensor) -> dict[str, int]:
    """Changed elements, bytes and blocks between two low-precision chunks (blocks counted
    from the tensor's start: chunks begin at multiples of every block size)."""
    elem = new.element_size()
    ow, nw = old.view(-1), new.view(-1)
    changed = ow.view(_int(elem)) != nw.view(_int(elem))
    out = {"elements": int(changed.sum()),
           "bytes": int((ow.view(torch.uint8) != nw.view(torch.uint8)).sum())}
    for b in BLOCKS:
        per = max(1, b // elem)
        pad = (-changed.numel()) % per
        m = torch.nn.functional.pad(changed, (0, pad)) if pad else changed
        out[f"blocks_{b}"] = int(m.view(-1, per).any(1).sum())
    return out


def _int(size: int) -> torch.dtype:
    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]


def _totals(specs: list[TensorSpec]) -> dict[str, int]:
    out = {"elements": sum(s.numel for s in specs), "bytes": sum(s.nbytes for s in specs)}
    for b in BLOCKS:
        out[f"blocks_{b}"] = sum(-(-s.nbytes // b) for s in specs)
    return out


def _chunks(update: AdamWUpdate, specs: list[TensorSpec]) -> Iterator[tuple[int, TensorSpec, int, int]]:
    align = max(BLOCKS)  # a chunk starts on every block boundary, so blocks never straddle two
    step = max(align, update.chunk_elems // align * align)
    for i, s in enumerate(specs):
        for lo in range(0, s.numel, step):
            yield i, s, lo, min(step, s.numel - lo)


def step_chunk(update: AdamWUpdate, spec: TensorSpec, index: int, lo: int, n: int, model_elems: int,
               start: torch.Tensor | None = None) -> list[torch.Tensor]:
    """The low-precision copy of elements ``lo:lo+n`` of tensor ``index`` after the warm-up and
    after each counted step (``steps + 1`` tensors), from its own seeded generator (the same
    numbers whatever order the chunks run in). ``model_elems``: every float element of the
    model, over which the gradient's norm is ``grad_norm``. ``start``: the chunk's current
    values (a real checkpoint's), instead of the synthetic initialisation."""
    if update.warmup_steps < 1 or update.steps < 1:
        raise ValueError("an AdamW update model needs warmup_steps >= 1 and steps >= 1")
    gen = torch.Generator().manual_seed(((update.seed * 1_000_003 + index) * 2**31 + lo) % 2**63)
    init = _init(spec, n, gen, update.init_std)  # drawn either way: the gradients' stream stays the same
    master = torch.nn.Parameter(init if start is None else start.to(torch.float32))
    opt = torch.optim.AdamW([master], lr=update.lr, betas=update.betas, eps=update.eps,
                            weight_decay=update.weight_decay, foreach=False)
    scale = update.grad_norm / math.sqrt(max(1, model_elems))
    mu = torch.randn(n, generator=gen) * (scale * math.sqrt(update.signal))
    noise = scale * math.sqrt(1.0 - update.signal)
    copies = []
    for t in range(update.warmup_steps + update.steps):
        master.grad = torch.randn(n, generator=gen).mul_(noise).add_(mu)
        opt.step()
        if t >= update.warmup_steps - 1:
            copies.append(master.detach().to(spec.torch_dtype))
    return copies


@dataclasses.dataclass
class Measured:
    update: dict[str, Any]
    totals: dict[str, int]
    per_step: list[dict[str, int]]  # changed counts of each counted step
    per_tensor_last: dict[str, int]  # changed elements per tensor, last step
    peak_state_bytes: int  # the largest chunk's optimizer state

    def fractions(self) -> list[dict[str, float]]:
        return [{k: c[k] / self.totals[k] for k in self.totals if self.totals[k]} for c in self.per_step]

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "fractions": self.fractions()}


def run(manifest: Manifest, update: AdamWUpdate, into: dict[str, torch.Tensor] | None = None,
        start: dict[str, torch.Tensor] | None = None
        ) -> tuple[Measured, dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
    """Steps every float tensor of ``manifest`` and counts what each counted step changed. With
    ``into`` (tensors of the manifest), writes the version before the last counted step there and
    returns per tensor ``(idx, vals_before, vals_after)``: the int32 flat indices that step
    changed and their two values, all a trainer needs to alternate between the two versions.
    ``start``: tensors (e.g. a checkpoint's) the masters start from (may be ``into`` itself)."""
    specs = _float_specs(manifest)
    model_elems = sum(s.numel for s in specs)
    per_step = [dict.fromkeys(_totals(specs), 0) for _ in range(update.steps)]
    last: dict[str, int] = {}
    parts: dict[str, list[tuple[torch.Tensor, ...]]] = {}
    peak = 0
    for i, spec, lo, n in _chunks(update, specs):
        peak = max(peak, n * _STATE_BYTES_PER_ELEM)
        first = None if start is None else start[spec.name].reshape(-1)[lo:lo + n]
        copies = step_chunk(update, spec, i, lo, n, model_elems, first)
        for k in range(update.steps):
            for key, v in _counts(copies[k], copies[k + 1]).items():
                per_step[k][key] += v
        before, after = copies[-2], copies[-1]
        idx = (before.view(_int(before.element_size())) != after.view(_int(after.element_size()))).nonzero().view(-1)
        last[spec.name] = last.get(spec.name, 0) + idx.numel()
        if into is not None:
            into[spec.name].view(-1)[lo:lo + n].copy_(before)
            parts.setdefault(spec.name, []).append(((idx + lo).to(torch.int32), before[idx], after[idx]))
        del copies
    kept = {name: tuple(torch.cat([p[j] for p in ps]) for j in range(3)) for name, ps in parts.items()}
    return Measured(update.describe(), _totals(specs), per_step, last, peak), kept


class Versions:
    """The trainer's side of ``--update``: ``apply(version)`` makes ``tensors`` that version and
    returns the fraction of elements that differ from the version before."""

    def __init__(self, tensors: dict[str, torch.Tensor], name: str = "random", manifest: Manifest | None = None,
                 start_from_tensors: bool = False):
        self.name = name
        self.tensors = tensors
        self.update = parse(name)
        self.measured: Measured | None = None
        self._pairs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        if self.update is not None:
            # stepped on the host, written into the tensors wherever they live
            host = {n: torch.empty_like(t, device="cpu") for n, t in tensors.items()} if any(
                t.device.type != "cpu" for t in tensors.values()) else tensors
            if host is not tensors and start_from_tensors:
                for n, t in tensors.items():
                    host[n].copy_(t)
            # a real checkpoint's weights are where the masters start; random bits are no weights
            self.measured, kept = run(manifest, self.update, into=host, start=host if start_from_tensors else None)
            for name, (idx, va, vb) in kept.items():
                flat = tensors[name].view(-1)
                if host is not tensors:
                    flat.copy_(host[name].view(-1))
                self._pairs.append((flat, idx.to(flat.device), va.to(flat.device), vb.to(flat.device)))
        total = sum(t.numel() for t in tensors.values())
        self.fraction = 1.0 if self.update is None else sum(p[1].numel() for p in self._pairs) / max(1, total)

    def apply(self, version: int) -> float:
        if self.update is None:
            for t in self.tensors.values():
                if t.numel():
                    f = t.view(-1).view(torch.uint8)
                    if t.dtype == torch.bool:
                        f.bitwise_xor_(1)  # only 0 / 1 are valid bool bytes
                    else:
                        f.add_(1)
            return 1.0
        for flat, idx, va, vb in self._pairs:
            if idx.numel():
                flat.index_copy_(0, idx.long(), vb if version % 2 else va)
        return self.fraction

    def describe(self) -> dict[str, Any]:
        if self.update is None:
            return {"model": "random", "changed_fraction": 1.0,
                    "how": "every byte of every tensor changes each version"}
        return {"model": self.name, **self.measured.to_dict(), "changed_fraction": self.fraction,
                "how": "versions alternate between the two bf16 copies around the last counted step, so each "
                       "differs from the one before by exactly that step's changed elements"}


def main(argv: list[str] | None = None) -> int:
    from .layouts import layout

    p = argparse.ArgumentParser(prog="python -m weightsync_bench.updates",
                                description="changed fraction of bf16 weights per AdamW step")
    p.add_argument("--layout", default="qwen2.5-0.5b")
    p.add_argument("--lr", nargs="+", type=float, default=[1e-6, 1e-5])
    p.add_argument("--warmup-steps", type=int, default=AdamWUpdate.warmup_steps)
    p.add_argument("--steps", type=int, default=AdamWUpdate.steps)
    p.add_argument("--signal", type=float, default=AdamWUpdate.signal)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a shared machine: one core
    try:
        out = [_measure(layout(args.layout), args, lr) for lr in args.lr]
    finally:
        torch.set_num_threads(threads)  # the caller's (a test process) setting back
    print(f"peak RSS {out[-1]['peak_rss_bytes'] / 2**30:.2f} GiB", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


def _measure(manifest: Manifest, args: argparse.Namespace, lr: float) -> dict[str, Any]:
    update = AdamWUpdate(lr=lr, warmup_steps=args.warmup_steps, steps=args.steps, signal=args.signal)
    measured, _ = run(manifest, update)
    rec = {"layout": args.layout, **measured.to_dict(),
           "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    for k, f in enumerate(rec["fractions"]):
        print(f"{args.layout} lr {lr:g} step {update.warmup_steps + k + 1}: "
              + ", ".join(f"{key} {v:.4%}" for key, v in f.items()), flush=True)
    return rec


if __name__ == "__main__":
    sys.exit(main())
