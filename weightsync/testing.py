"""Stand-ins for a trainer and an inference engine, used by the tests, the benchmark and the
README example. Real weightsync parties, real Ray actors; only the model is a dict."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from typing import Any

import torch

from .config import SyncConfig
from .coordinator import Coordinator
from .layouts import materialize
from .manifest import Manifest
from .receiver import WeightReceiver
from .sender import WeightSender


class ToyEngine:
    """A model as a dict of tensors with vLLM's ``load_weights`` contract (copy in place)."""

    def __init__(self, manifest: Manifest, device: str = "cpu", load_delay_s: float = 0.0):
        self.params = {s.name: torch.zeros(s.shape, dtype=s.torch_dtype, device=device) for s in manifest}
        self.loads = 0
        self.post_loads = 0
        self.load_delay_s = load_delay_s  # a slow engine, so faults can land mid-transfer

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        if self.load_delay_s:
            time.sleep(self.load_delay_s)
        done = set()
        for name, tensor in weights:
            self.params[name].copy_(tensor)
            done.add(name)
        self.loads += 1
        return done

    def post_load(self) -> None:
        self.post_loads += 1


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality (NaN payloads and -0.0 included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


class RolloutWorker:
    """A rollout worker: one receiver feeding a ToyEngine. Wrap with ``ray.remote``."""

    def __init__(self, coordinator: Coordinator, manifest_wire: list, name: str, rank: int = 0,
                 config: dict | None = None, check: bool = True, expected_wire: list | None = None,
                 load_delay_s: float = 0.0, device: str = "cpu"):
        manifest = Manifest.from_wire(manifest_wire)
        model = Manifest.from_wire(expected_wire) if expected_wire is not None else manifest
        self.engine = ToyEngine(model, device=device, load_delay_s=load_delay_s)
        cfg = SyncConfig.load(config) if config is not None else None
        self.receiver = WeightReceiver(
            coordinator, self.engine.load_weights, name=name, rank=rank, post_load=self.engine.post_load,
            expected={s.name: s for s in model} if check else None, config=cfg,
        )

    def apply(self, version: int | None = None, timeout: float | None = None, wait: bool = True) -> int | None:
        return self.receiver.apply(version, timeout=timeout, wait=wait)

    def prefetch(self, version: int | None = None) -> int | None:
        return self.receiver.prefetch(version)

    def version(self) -> int | None:
        return self.receiver.version

    def weights(self) -> dict[str, torch.Tensor]:
        return {n: t.cpu().clone() for n, t in self.engine.params.items()}

    def counters(self) -> dict[str, Any]:
        return {"loads": self.engine.loads, "post_loads": self.engine.post_loads,
                "metrics": self.receiver.last_metrics}

    def pid(self) -> int:
        return os.getpid()

    def rss(self) -> int:
        return _rss()

    def close(self) -> None:
        self.receiver.close()


class TrainerWorker:
    """A trainer rank whose weights for version v are ``materialize(manifest, seed=v)``."""

    def __init__(self, coordinator: Coordinator, manifest_wire: list, rank: int = 0,
                 config: dict | None = None, expected_receivers: int | None = None, device: str = "cpu"):
        self.manifest, self.device = Manifest.from_wire(manifest_wire), device
        cfg = SyncConfig.load(config) if config is not None else None
        self.sender = WeightSender(coordinator, rank=rank, config=cfg, expected_receivers=expected_receivers)

    def stage(self, version: int, seed: int | None = None, delay_s: float = 0.0,
              named: list | None = None) -> float:
        """Stage the weights of ``version``. ``delay_s`` slows the tensor iteration (a trainer
        still gathering), ``named`` replaces the tensors (bad-input tests)."""
        tensors = named if named is not None else materialize(self.manifest, seed=version if seed is None else seed,
                                                              device=self.device)
        if delay_s:
            items = tensors.items() if isinstance(tensors, dict) else tensors
            tensors = ((n, t) for n, t in items if time.sleep(delay_s) is None)
        return self.sender.stage(version, tensors).wait()

    def sync(self, version: int, timeout: float | None = None) -> dict[str, Any]:
        r = self.sender.sync(version, timeout=timeout)
        return {"version": r.version, "stage_s": r.stage_s, "barrier_s": r.barrier_s, "bytes": r.bytes,
                "metrics": r.metrics}

    def step(self, version: int, seed: int | None = None) -> dict[str, Any]:
        self.stage(version, seed)
        return self.sync(version)

    def pid(self) -> int:
        return os.getpid()

    def rss(self) -> int:
        return _rss()

    def close(self) -> None:
        self.sender.close()


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss
