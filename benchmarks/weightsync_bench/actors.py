"""Internal. The benchmark's parties: one trainer and N rollout workers as Ray actors.

They hold their model for the whole run, so every row (each transport, bucket size and
baseline) moves the same bytes between the same processes; only the session changes. The
sync rows go through the public WeightSender / WeightReceiver, exactly as a user's code.
"""

from __future__ import annotations

import os
import time
import warnings
from typing import Any

import torch

from weightsync.config import SyncConfig
from weightsync.coordinator.client import Coordinator
from weightsync.manifest import Manifest
from weightsync.receiver import WeightReceiver
from weightsync.sender import WeightSender

from .bits import digest
from .bits import flat_bytes as _flat
from .engine import ToyEngine
from .layouts import materialize
from .peak_memory import PeakTracker
from .updates import Versions


def _collective():
    """weightsync_bench.collective_baselines if it is installed (written separately), else None."""
    try:
        from . import collective_baselines
    except ImportError:
        return None
    return collective_baselines


def _calls(result: Any) -> dict[str, int | None]:
    """A version's coordinator calls from its SyncResult; None where the sender does not count them."""
    return {"stage_calls": getattr(result, "stage_calls", None), "sync_calls": getattr(result, "sync_calls", None)}


def numpy_views(tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Each tensor's bytes as a flat uint8 numpy view: the best Ray path (the ray-numpy rows),
    written once into the object store and read zero-copy."""
    return {n: _flat(t.cpu()).numpy() for n, t in tensors.items()}


class BenchTrainer:
    """Trainer rank 0: holds the model, makes each version from the one before by the run's
    update model (weightsync_bench.updates: every byte, or an AdamW step) and sends."""

    def __init__(self, manifest_wire: list, device: str = "cpu", weights_path: str | None = None, seed: int = 0,
                 update: str = "random"):
        self.manifest = Manifest.from_wire(manifest_wire)
        self.device = device
        if weights_path:
            from .layout_source import load_weights

            self.tensors = {n: t.to(device) for n, t in load_weights(weights_path, self.manifest).items()}
        else:
            self.tensors = materialize(self.manifest, seed=seed, device=device)
        self.versions = Versions(self.tensors, update, self.manifest, start_from_tensors=bool(weights_path))
        self.sender: WeightSender | None = None
        self.peak = PeakTracker()
        self.state: dict[str, Any] = {}

    def pid(self) -> int:
        return os.getpid()

    def bump(self, version: int) -> float:
        """Make ``version``; the fraction of elements that differ from the version before."""
        return self.versions.apply(version)

    def update_info(self) -> dict[str, Any]:
        return self.versions.describe()

    def digest(self) -> str:
        return digest(self.tensors)

    def start_peak(self) -> None:
        self.peak.start()

    def peak_extra(self) -> int:
        return self.peak.extra()

    # -- weightsync sessions --------------------------------------------------------------

    def open(self, coordinator: Coordinator, config: dict, receivers: int) -> None:
        self.sender = WeightSender(coordinator, config=SyncConfig.load(config), expected_receivers=receivers)
        self.peak.start()

    def step(self, version: int) -> dict[str, Any]:
        """One version as a trainer runs it: stage, then the barrier."""
        changed = self.bump(version)
        t0 = time.monotonic()
        stage_s = self.sender.stage(version, self.tensors).wait()
        r = self.sender.sync(version)
        return {"t0": t0, "end": time.monotonic(), "stage_s": stage_s, "barrier_s": r.barrier_s,
                "metrics": r.metrics.as_dict(), "changed_fraction": changed, **_calls(r)}

    def stage(self, version: int) -> float:
        # the reply stays a float, as every revision's stage() gives it (the runner drives an
        # --against revision's actors by it); the staging's calls come with sync()'s reply
        self.bump(version)
        return self.sender.stage(version, self.tensors).wait()

    def sync(self, version: int) -> dict[str, Any]:
        r = self.sender.sync(version)
        return {"end": time.monotonic(), "stage_s": r.stage_s, "barrier_s": r.barrier_s, "metrics": r.metrics.as_dict(),
                **_calls(r)}

    def shm_bytes(self) -> int:
        """Bytes of this process's segments: memfds it holds, files in the shm directory (0 for
        transports without segments)."""
        from weightsync.transports.shm.transport import holders

        directory = self.sender.config.shm_dir if self.sender else "/dev/shm"
        prefix = f"wsync_{os.getpid()}_"
        sizes = {}
        for _, fd, name in holders(pids=[os.getpid()]):  # one segment may be on several fds (mmap keeps a dup)
            try:
                sizes[name] = os.stat(f"/proc/self/fd/{fd}").st_blocks * 512
            except OSError:
                pass
        try:
            for name in os.listdir(directory):
                if name.startswith(prefix):
                    sizes[name] = os.stat(os.path.join(directory, name)).st_blocks * 512
        except OSError:
            pass
        return sum(sizes.values())

    def close_session(self) -> dict[str, Any]:
        out = {"peak_extra": self.peak.extra(), "shm_bytes": self.shm_bytes(),
               "transport": self.sender.transport_name if self.sender else None,
               "delta_state": self.sender.delta_state() if self.sender else None}
        if self.sender is not None:
            self.sender.close()
            self.sender = None
        return out

    # -- Ray object store baselines --------------------------------------------------------

    def ray_put(self, kind: str, version: int) -> dict[str, Any]:
        import ray

        changed = self.bump(version)
        t0 = time.monotonic()
        if kind == "ray-user":
            # what a user writes: the state dict of torch tensors, through the object store
            obj: Any = dict(self.tensors)
        else:
            obj = numpy_views(self.tensors)
        ref = ray.put(obj)
        # nested in a list so Ray hands the receivers the reference, not the value
        return {"t0": t0, "put_s": time.monotonic() - t0, "ref": [ref], "changed_fraction": changed}

    # -- collective baselines (weightsync_bench.collective_baselines) --------------------------------

    def collective_call(self, fn: str, *args: Any, **kwargs: Any) -> Any:
        mod = _collective()
        return getattr(mod, fn)(self, *args, **kwargs)

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
            self.sender = None


class BenchRollout:
    """One rollout worker: the tests' engine stand-in (ToyEngine: pages resident from the
    start) fed by a WeightReceiver (or by a baseline). Apart from the tests' RolloutWorker
    because a bench rollout outlives its sessions (one per row) and tracks peak memory, and
    because this revision's runner drives an ``--against`` revision's actors by these methods
    (interleave.py): their names and replies are an interface between revisions, the tests'
    stand-ins are free to change."""

    def __init__(self, manifest_wire: list, name: str, rank: int, device: str = "cpu"):
        self.manifest = Manifest.from_wire(manifest_wire)
        self.name, self.rank, self.device = name, rank, device
        self.engine = ToyEngine(self.manifest, device)
        self.receiver: WeightReceiver | None = None
        self.peak = PeakTracker()
        self.state: dict[str, Any] = {}

    def pid(self) -> int:
        return os.getpid()

    def digest(self) -> str:
        return digest(self.engine.params)

    def start_peak(self) -> None:
        self.peak.start()

    def peak_extra(self) -> int:
        return self.peak.extra()

    def open(self, coordinator: Coordinator, config: dict) -> None:
        # copy_in: the bare copies, so a row times the transfer, not the stand-in's counters
        self.receiver = WeightReceiver(
            coordinator, self.engine.copy_in, name=self.name, rank=self.rank,
            expected={s.name: s for s in self.manifest}, config=SyncConfig.load(config),
        )
        self.peak.start()

    def prefetch(self, version: int) -> int | None:
        return self.receiver.prefetch(version)

    def apply(self, version: int) -> dict[str, Any]:
        served = self.receiver.apply(version)
        # plain maps, as every revision's actors give them (the runner reads an --against revision's too)
        m = self.receiver.last_metrics
        return {"end": time.monotonic(), "version": served, "metrics": m.as_dict() if m is not None else {}}

    def close_session(self) -> dict[str, Any]:
        out = {"peak_extra": self.peak.extra()}
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None
        return out

    def ray_load(self, refs: list) -> dict[str, Any]:
        """Load the version behind ``refs``: one ref per sender, each a map of name to a tensor or
        its bytes (numpy). Several senders are trainer ranks, each with its own rows (``Shard(0)``)
        in rank order: each tensor's rows are joined first, as a user assembling shards would."""
        import numpy as np
        import ray

        objs = ray.get(list(refs))
        specs = {s.name: s for s in self.manifest}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # zero-copy numpy arrays are read-only

            def pairs():
                for name in dict.fromkeys(n for obj in objs for n in obj):
                    parts = [obj[name] for obj in objs if name in obj]
                    value = parts[0] if len(parts) == 1 else (
                        torch.cat(parts) if isinstance(parts[0], torch.Tensor) else np.concatenate(parts))
                    if isinstance(value, torch.Tensor):
                        yield name, value
                    else:
                        s = specs[name]
                        yield name, torch.from_numpy(value).view(s.torch_dtype).view(s.shape)

            self.engine.copy_in(pairs())
        return {"end": time.monotonic()}

    def collective_call(self, fn: str, *args: Any, **kwargs: Any) -> Any:
        mod = _collective()
        return getattr(mod, fn)(self, *args, **kwargs)

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None
