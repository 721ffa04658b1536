"""The rollout's stall per version with and without ``receive_ahead``, against one local copy
of the payload, same run, interleaved (docs/one-step-off.md).

    python benchmarks/receive_ahead.py [--transports broadcast,shm] [--rounds 6] [--json PATH]

Per transport two jobs run side by side, each a coordinator, 2 rollout workers and a trainer
(real Ray actors, tests/support/parties.py): one with ``receive_ahead: off``, one with ``on``. Each
round moves one version through each job, the order alternating, as the one-step-off recipe
does it: the trainer stages the version (right after its optimizer step), the rollout keeps
generating (here: with receive_ahead, waits until the version is in, ``prefetch()``; without,
the shm version is pre-staged and nothing verified ahead), then the barrier: the
rollouts apply it while the trainer syncs. The stall is what the rollout's ``apply()`` spent
from its first bucket to the reset cache (``total_s`` of its metrics, the slower rollout);
``barrier_s`` is the trainer's ``sync()``. One copy: ``copy_`` of a payload-sized buffer into
another in a rollout-like process, median of 5; and the same in two processes at once, as
the two rollouts load at the barrier at once on this host (the slower one's median). The goal (issue 37): stall <= 1.2x one copy.
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
from weightsync_bench.layouts import _dense

from weightsync.manifest import Manifest

# the tests' party actors (tests/support/parties.py), importable here and in the Ray workers this
# process starts, which inherit PYTHONPATH
_TESTS = str(Path(__file__).resolve().parents[1] / "tests")
sys.path.insert(0, _TESTS)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [_TESTS, os.environ.get("PYTHONPATH")]))

from support.parties import new_coordinator, rollout_actor, stop_actors, trainer_actor  # noqa: E402

# Qwen2.5-0.5B's widths with a 32k vocabulary and 3 layers: ~200 MB in bf16
MANIFEST = Manifest(tuple(_dense(32000, 896, 4864, 3, 14, 2, 64, True, False, False, "bfloat16")))
CFG = {"heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 10.0, "sync_timeout_s": 300.0,
       "connect_timeout_s": 120.0, "device": "cpu", "bucket_mb": 16.0}


@ray.remote(num_cpus=0)
def one_copy(nbytes: int, repeats: int = 5) -> float:
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch of the pages, untimed
    took = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        took.append(time.perf_counter() - t0)
    return statistics.median(took)


class Pair:
    """One job: coordinator, rollout-0 and rollout-1, trainer."""

    def __init__(self, transport: str, ahead: str):
        self.cfg = {**CFG, "transport": transport, "receive_ahead": ahead}
        self.ahead = ahead != "off"
        self.coord = new_coordinator(self.cfg, prefix=f"ws-ahead-bench-{ahead}")
        opts = {"max_concurrency": 4}
        self.rollouts = [rollout_actor(self.coord, MANIFEST, f"rollout-{i}", i, self.cfg, opts) for i in range(2)]
        self.trainer = trainer_actor(self.coord, MANIFEST, self.cfg, 2, opts)
        self.v = 0

    def version(self, warm: bool = False) -> dict[str, float]:
        self.v += 1
        v = self.v
        ray.get(self.trainer.stage.remote(v))  # right after the optimizer step
        if self.ahead:  # the rollout generates meanwhile; its ahead thread takes the version
            took = ray.get([r.prefetch.remote(v) for r in self.rollouts])
            assert warm or took == [v, v], f"version {v} did not arrive ahead: {took}"
        applied = [r.apply.remote(v) for r in self.rollouts]
        result = ray.get(self.trainer.sync.remote(v))
        assert ray.get(applied) == [v, v]
        metrics = [ray.get(r.counters.remote()).metrics for r in self.rollouts]
        slow = max(metrics, key=lambda m: m.total_s)
        return {"stall_s": slow.total_s, "barrier_s": result.barrier_s,
                "parts_s": {k: slow[k] for k in ("wait_s", "verify_s", "load_s", "post_load_s")},
                "ahead": all(m.received_ahead for m in metrics)}

    def close(self) -> None:
        stop_actors([*self.rollouts, self.trainer])
        self.coord.shutdown()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--transports", default="broadcast,shm")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    payload = sum(s.nbytes for s in MANIFEST)
    out = {"payload_bytes": payload, "load_average": os.getloadavg()[0], "cores": os.cpu_count(), "rows": []}
    try:
        copy_s = ray.get(one_copy.remote(payload))
        out["one_copy_s"] = copy_s
        # both rollouts load at the barrier at once, on the same cores and memory: the same copy
        # made by two processes at once is the like-for-like floor of that stall
        both = max(ray.get([one_copy.remote(payload, 9), one_copy.remote(payload, 9)]))
        out["one_copy_two_at_once_s"] = both
        for transport in args.transports.split(","):
            pairs = {"off": Pair(transport, "off"), "on": Pair(transport, "on")}
            try:
                for p in pairs.values():
                    p.version(warm=True)  # the session opens, the ahead threads come up: untimed
                    p.version(warm=True)
                got: dict[str, list[dict]] = {"off": [], "on": []}
                for r in range(args.rounds):
                    for mode in (("off", "on") if r % 2 == 0 else ("on", "off")):
                        got[mode].append(pairs[mode].version())
                for mode, rows in got.items():
                    stall = statistics.median(x["stall_s"] for x in rows)
                    barrier = statistics.median(x["barrier_s"] for x in rows)
                    row = {"transport": transport, "receive_ahead": mode, "stall_s": stall, "barrier_s": barrier,
                           "stall_x_copy": stall / copy_s, "barrier_x_copy": barrier / copy_s,
                           "stall_x_two_copies_at_once": stall / both,
                           "received_ahead": all(x["ahead"] for x in rows), "stalls_s": [x["stall_s"] for x in rows],
                           "parts_s": {k: statistics.median(x["parts_s"][k] for x in rows) for k in rows[0]["parts_s"]}}
                    out["rows"].append(row)
                    print(f"{transport:9s} receive_ahead {mode:3s}: rollout stall {stall * 1e3:7.1f} ms "
                          f"({row['stall_x_copy']:.2f}x one copy), trainer barrier {barrier * 1e3:7.1f} ms "
                          f"({row['barrier_x_copy']:.2f}x), {stall / both:.2f}x two copies at once; "
                          f"received ahead: {row['received_ahead']}; stall: "
                          + ", ".join(f"{k} {t * 1e3:.1f}" for k, t in row["parts_s"].items()), flush=True)
            finally:
                for p in pairs.values():
                    p.close()
        out["load_average_after"] = os.getloadavg()[0]
        print(f"payload {payload / 2**20:.0f} MiB, one copy {copy_s * 1e3:.1f} ms, two processes copying at once "
              f"{both * 1e3:.1f} ms; load average "
              f"{out['load_average']:.2f} -> {out['load_average_after']:.2f} on {out['cores']} cores")
    finally:
        ray.shutdown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
