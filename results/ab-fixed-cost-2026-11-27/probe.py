"""A driver-timed pre-staged barrier of N tensors of 2 KiB (qwen2.5-0.5b names), 1 receiver:
    python probe.py shm|ipc [N]     (results/ab-fixed-cost-2026-11-27/README.md)"""
import statistics, sys, time, os
import ray, torch
from weightsync import Coordinator
from weightsync.manifest import Manifest, TensorSpec
from weightsync.testing.layouts import layout
from weightsync.testing.parties import RolloutWorker, TrainerWorker

def tiny(n=291, per=2048):
    base = layout("qwen2.5-0.5b")
    return Manifest(tuple(TensorSpec(s.name, s.dtype, (per // 2,)) for s in base.specs[:n]))

transport = sys.argv[1]; ntens = int(sys.argv[2]) if len(sys.argv) > 2 else 291
ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
man = tiny(ntens)
cfg = {"transport": transport, "device": "cpu", "bucket_mb": 16}
coord = Coordinator.create(cfg, name="probe")
R = ray.remote(RolloutWorker).options(max_concurrency=4)
T = ray.remote(TrainerWorker).options(max_concurrency=4)
rx = R.remote(coord, man.to_wire(), "rollout-0", config=cfg)
tr = T.remote(coord, man.to_wire(), config=cfg, expected_receivers=1)
times = []
for v in range(1, 41):
    ray.get(tr.stage.remote(v))
    t0 = time.perf_counter()
    a = rx.apply.remote(v); s = tr.sync.remote(v)
    ray.get([a, s])
    if v > 10: times.append(time.perf_counter() - t0)
st = coord.status()["calls"]
print(transport, ntens, "median %.1f ms  min %.1f  p75 %.1f" % (statistics.median(times)*1e3, min(times)*1e3, statistics.quantiles(times, n=4)[2]*1e3))
ray.shutdown()
