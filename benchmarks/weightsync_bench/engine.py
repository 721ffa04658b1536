"""Internal. The engine stand-in: a model as a dict of tensors."""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch

from weightsync import device as devices
from weightsync.manifest import Manifest
from weightsync.targets import CopyInto


class ToyEngine:
    """A model as a dict of tensors with vLLM's ``load_weights`` contract (copy in place): the
    one engine stand-in of the tests, the bench and benchmarks/floors.py. Its parameters are
    zeroed at construction, which writes every page, so the first sync pays no page faults
    (the bench times it)."""

    def __init__(self, manifest: Manifest, device: str = "cpu", load_delay_s: float = 0.0):
        where = devices.resolve(device)
        self.params = {s.name: torch.zeros(s.shape, dtype=s.torch_dtype, device=where) for s in manifest}
        self.loads = 0
        self.post_loads = 0
        self.load_delay_s = load_delay_s  # a slow engine, so faults can land mid-transfer
        self._batched = CopyInto(self.params)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        if self.load_delay_s:
            time.sleep(self.load_delay_s)
        done = set()
        for name, tensor in weights:
            self.params[name].copy_(tensor)
            done.add(name)
        self.loads += 1
        return done

    def copy_in(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """``load_weights`` with nothing but the copies, batched (weightsync.CopyInto): no names
        kept, no counts, no delay. The bench's loader for every row, baselines included, so a
        row times the transfer and not the stand-in's bookkeeping."""
        self._batched.load_weights(weights)

    def post_load(self) -> None:
        self.post_loads += 1
