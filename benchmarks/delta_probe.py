"""A quick probe of delta sync against full sync, per transport, in one run: real Ray actors,
one trainer and one rollout worker on this machine. Each version moves ``--changed`` of the
bf16 elements (random positions, the worst case for skipping buckets); the first version of
each run is full and not timed. The bench rows (an AdamW-step generator, ``--delta`` rows in
the bench JSON) are the benchmark's; this probe only checks the direction quickly.

    python benchmarks/delta_probe.py --layout qwen2.5-0.5b --changed 0.01 --versions 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import ray
import torch
from weightsync_bench.layouts import layout, materialize

# the tests' party actors (tests/support/parties.py), importable here and in the Ray workers this
# process starts, which inherit PYTHONPATH
_TESTS = str(Path(__file__).resolve().parents[1] / "tests")
sys.path.insert(0, _TESTS)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [_TESTS, os.environ.get("PYTHONPATH")]))

from support.parties import JOB_DEFAULTS, TrainerWorker, new_coordinator, rollout_actor, stop_actors  # noqa: E402


class DriftTrainer(TrainerWorker):
    """Version v: the previous version with ``changed`` of each tensor's elements moved."""

    def drift(self, version: int, changed: float) -> None:
        if not hasattr(self, "cur"):
            self.cur = materialize(self.manifest, seed=0)
        g = torch.Generator().manual_seed(version)
        for t in self.cur.values():
            flat = t.view(-1)
            k = max(1, int(flat.numel() * changed))
            idx = torch.randint(0, flat.numel(), (k,), generator=g)
            flat[idx] = torch.randn(k, generator=g).to(flat.dtype)

    def stage_cur(self, version: int) -> float:
        return self.sender.stage(version, self.cur).wait()


def run(transport: str, delta: str, args: argparse.Namespace) -> list[float]:
    manifest = layout(args.layout)
    cfg = {**JOB_DEFAULTS, "transport": transport, "delta": delta, "sync_timeout_s": 600.0}
    coord = new_coordinator(cfg, "ws-delta-probe")
    rollout = rollout_actor(coord, manifest, "rollout-0", 0, cfg, check=False)
    trainer = ray.remote(DriftTrainer).options(num_cpus=0).remote(coord, manifest.to_wire(), config=cfg,
                                                                   expected_receivers=1)
    times = []
    try:
        for v in range(1, args.versions + 2):
            ray.get(trainer.drift.remote(v, args.changed))
            applied = rollout.apply.remote(v)
            t0 = time.perf_counter()  # stage + sync: what the trainer waits for
            ray.get(trainer.stage_cur.remote(v))
            ray.get(trainer.sync.remote(v))
            dt = time.perf_counter() - t0
            assert ray.get(applied) == v
            if v > 1:
                times.append(dt)
    finally:
        stop_actors([rollout, trainer])
        coord.shutdown()
    return times


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layout", default="qwen2.5-0.5b")
    p.add_argument("--changed", type=float, default=0.01)
    p.add_argument("--versions", type=int, default=3)
    p.add_argument("--transports", default="broadcast,shm,ipc")
    args = p.parse_args()
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False,
             object_store_memory=256 * 2**20)
    out = {}
    try:
        for transport in args.transports.split(","):
            for delta in ("off", "on"):
                times = run(transport, delta, args)
                out[f"{transport}/{delta}"] = {"median_s": statistics.median(times), "times_s": times}
                print(json.dumps({f"{transport}/{delta}": out[f"{transport}/{delta}"]}), flush=True)
    finally:
        ray.shutdown()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
