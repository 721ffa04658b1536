"""One host, RANKS gloo trainer ranks (FSDP2-style Shard(0) DTensors of the 0.5B layout), shm, 1 receiver:
time from a barrier (the end of the update) until rank 0's stage() returned, gather (full_tensor + rank 0
packs) vs shards (each rank writes its rows), interleaved rounds. Peak RSS growth per rank during stage."""
import os, statistics, sys, threading, time
import ray, torch
from support.parties import new_coordinator, rollout_actor, stop_actors
from support.shards import ShardedTrainer, free_port
from weightsync.manifest import chunk_bounds
from weightsync_bench.layouts import layout

RANKS = int(os.environ.get("RANKS", 4)); ROUNDS = int(os.environ.get("ROUNDS", 3))


def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def private():
    # RSS without shared pages (the segment is mapped by every rank and the receivers)
    with open("/proc/self/status") as f:
        d = dict(l.split(":", 1) for l in f)
    return (int(d["RssAnon"].split()[0])) * 1024


class Rank(ShardedTrainer):
    def prepare(self, version):
        from torch.distributed.tensor import DTensor, Shard
        r, n = self.mesh.get_local_rank(), self.mesh.size()
        self.named = {}
        for s in self.manifest:
            if not s.shape:
                self.named[s.name] = torch.full((), float(version), dtype=s.torch_dtype)
                continue
            b = chunk_bounds(s.shape[0], n)
            local = torch.full((b[r + 1] - b[r], *s.shape[1:]), float(version % 7 + r), dtype=s.torch_dtype)
            full = torch.empty(s.shape, dtype=s.torch_dtype, device="meta")
            self.named[s.name] = DTensor.from_local(local, self.mesh, [Shard(0)], run_check=False,
                                                    shape=full.shape, stride=full.stride())
        return sum(t.to_local().numel() * t.element_size() for t in self.named.values() if hasattr(t, "to_local"))

    def timed(self, version, gather):
        import torch.distributed as dist
        named = self.named
        if gather:
            named = ((n, t.full_tensor() if hasattr(t, "full_tensor") else t) for n, t in self.named.items())
        peak, stop = [private()], threading.Event()
        def watch():
            while not stop.is_set():
                peak.append(private()); time.sleep(0.005)
        th = threading.Thread(target=watch); base = peak[0]; th.start()
        dist.barrier()
        t0 = time.perf_counter()
        self.sender.stage(version, named).wait()
        staged = time.perf_counter() - t0
        stop.set(); th.join()
        self.sender.sync(version)
        return staged, time.perf_counter() - t0, max(peak) - base


ray.init(address="local", num_cpus=16, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
manifest = layout("qwen2.5-0.5b")
cfg = {"transport": "shm", "heartbeat_timeout_s": 30.0, "sync_timeout_s": 300.0, "connect_timeout_s": 120.0}
jobs = {}
for row in ("gather", "shards"):
    coord = new_coordinator(cfg, prefix=f"m56-{row}")
    rollouts = [rollout_actor(coord, manifest, "rollout-0", 0, cfg, check=False)]
    port = free_port()
    trainers = [ray.remote(Rank).options(num_cpus=0).remote(coord, manifest.to_wire(), r, RANKS, port, config=cfg,
                                                             expected_receivers=1) for r in range(RANKS)]
    jobs[row] = (coord, rollouts, trainers)
res = {"gather": [], "shards": []}
versions = {"gather": 0, "shards": 0}
shard_bytes = None
for rnd in range(ROUNDS + 1):
    for row in (("gather", "shards") if rnd % 2 == 0 else ("shards", "gather")):
        coord, rollouts, trainers = jobs[row]
        versions[row] += 1
        v = versions[row]
        shard_bytes = ray.get([t.prepare.remote(v) for t in trainers], timeout=600)
        applied = [r.apply.remote(v) for r in rollouts]
        out = ray.get([t.timed.remote(v, row == "gather") for t in trainers], timeout=600)
        ray.get(applied, timeout=600)
        if rnd > 0:  # round 0 warms up: segments created and mapped
            res[row].append(out)
        print(row, v, "staged", [round(o[0], 3) for o in out], "peak+MiB", [round(o[2] / 2**20) for o in out], flush=True)
print("shard MiB per rank", [round(b / 2**20) for b in shard_bytes], "payload", round(manifest.total_bytes / 2**30, 3), "GiB")
for row, xs in res.items():
    st = [x[0][0] for x in xs]; tot = [x[0][1] for x in xs]
    peaks = [max(o[2] for o in x) for x in xs]
    print(f"{row}: staged median {statistics.median(st):.3f} s (min {min(st):.3f}, max {max(st):.3f}); "
          f"until committed {statistics.median(tot):.3f} s; max peak private growth of a rank {max(peaks) / 2**20:.0f} MiB")
g = statistics.median([x[0][0] for x in res["gather"]]); s = statistics.median([x[0][0] for x in res["shards"]])
print(f"gather / shards (staged): {g / s:.1f}x")
for coord, rollouts, trainers in jobs.values():
    stop_actors([*trainers, *rollouts]); coord.shutdown()
ray.shutdown()
