"""One-step-off-policy RL on CPU, with and without overlap, and a timeline of both.

A small torch policy learns a toy sequence task with REINFORCE: given a start token, write
a sequence in which every token is the previous one plus one (mod the vocabulary); each
token that follows the rule earns 1 (the printed reward is the mean). One trainer Ray actor
runs a real Adam step on a real loss; two rollout Ray actors sample batches with the weights
they were last synced to and tag each batch with the version they served (receiver.version).

It runs twice:
  sync         generate batch s  ->  train step s  ->  stage + sync version s+1
  one-step-off train step s on batch s  ||  generate batch s+1 with version s,
               stage version s+1 in the background right after the optimizer step,
               then a short barrier where only the receivers' work is left
and prints per-step times, the version of every batch, and writes a timeline PNG.

On a machine with accelerators the trainer and the rollout run on different devices. Here
the CPU cores play the devices: the trainer is pinned to the first half of the cores and
both rollout workers to the second half (one core each side on a 2-core machine), with one
torch thread per actor, so the two sides do not steal each other's compute.

Run:  python examples/one_step_off_cpu.py            (about a minute; --quick for a smoke run)
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import secrets
import statistics
import sys
import time
from typing import Any

import ray
import torch
from weightsync_bench.timeline import Recorder, Span, render_png

from weightsync import Coordinator, SyncConfig, WeightReceiver, WeightSender
from weightsync.transports.shm.transport import reap_stale


@dataclasses.dataclass(frozen=True)
class Task:
    vocab: int = 16
    length: int = 128  # tokens generated per sequence, one at a time
    embed: int = 32
    hidden: int = 256
    depth: int = 6
    batch: int = 24  # sequences per step, split over the rollout workers
    lr: float = 3e-3


# --quick and the tests: the same loop, a smaller network, reward still climbs within 8 steps
QUICK_TASK = Task(length=32, hidden=128, depth=3, batch=32, lr=1e-2)


class Policy(torch.nn.Module):
    """Next-token logits from (previous token, position): small, but a real network."""

    def __init__(self, task: Task):
        super().__init__()
        self.tok = torch.nn.Embedding(task.vocab, task.embed)
        self.pos = torch.nn.Embedding(task.length, task.embed)
        layers: list[torch.nn.Module] = []
        width = 2 * task.embed
        for _ in range(task.depth):
            layers += [torch.nn.Linear(width, task.hidden), torch.nn.Tanh()]
            width = task.hidden
        layers.append(torch.nn.Linear(width, task.vocab))
        self.mlp = torch.nn.Sequential(*layers)

    def forward(self, prev: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return self.mlp(torch.cat([self.tok(prev), self.pos(pos).expand(*prev.shape, -1)], dim=-1))


def reward(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """Per generated token: 1 where it equals the previous token plus one (mod vocab), else 0."""
    return (tokens[:, 1:] == (tokens[:, :-1] + 1) % vocab).float()


def weights_digest(model: torch.nn.Module) -> str:
    """A fingerprint of the exact bits a model holds (tests match batches to versions with it)."""
    h = hashlib.blake2b(digest_size=16)
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def pin(cpus: list[int] | None) -> None:
    torch.set_num_threads(1)
    if cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cpus)


@ray.remote(num_cpus=0)
class Rollout:
    """Stands in for a vLLM worker: samples with the weights it serves, tags the batch. Not
    the tests' RolloutWorker: this one generates with a real policy, and the example reads
    in one file."""

    def __init__(self, coordinator: Coordinator, task: Task, rank: int, cpus: list[int] | None):
        pin(cpus)
        self.task, self.name = task, f"rollout-{rank}"
        self.policy = Policy(task).eval()
        params = dict(self.policy.named_parameters())

        def load_weights(weights):
            with torch.no_grad():
                for name, tensor in weights:
                    params[name].copy_(tensor)

        self.receiver = WeightReceiver(coordinator, load_weights, name=self.name, rank=rank,
                                       expected=self.policy.state_dict())
        self.gen = torch.Generator().manual_seed(1000 + rank)
        self.timeline = Recorder(self.name)

    def apply(self, version: int) -> int:
        with self.timeline.span("apply"):
            return self.receiver.apply(version)

    @torch.no_grad()
    def generate(self, n: int) -> dict[str, Any]:
        version = self.receiver.version  # the tag: the weights this whole batch is sampled with
        digest = weights_digest(self.policy)
        start = time.time()
        tokens = torch.empty(n, self.task.length + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(self.task.vocab, (n,), generator=self.gen)
        logp = torch.empty(n, self.task.length)
        for t in range(self.task.length):
            dist = torch.log_softmax(self.policy(tokens[:, t], torch.tensor(t)), dim=-1)
            nxt = torch.multinomial(dist.exp(), 1, generator=self.gen).squeeze(1)
            tokens[:, t + 1] = nxt
            logp[:, t] = dist.gather(1, nxt[:, None]).squeeze(1)
        end = time.time()
        self.timeline.add("generate", start, end)
        if self.receiver.version != version:
            raise RuntimeError(f"{self.name}: weights changed while a batch was generated")
        return {"worker": self.name, "version": version, "digest": digest, "tokens": tokens, "logp": logp,
                "reward": reward(tokens, self.task.vocab), "gen_s": end - start}

    def spans(self) -> list[list[Any]]:
        return self.timeline.drain()

    def close(self) -> None:
        self.receiver.close()


@ray.remote(num_cpus=0)
class Trainer:
    """Trainer rank 0: REINFORCE step on the batches, then stages the new version."""

    def __init__(self, coordinator: Coordinator, task: Task, workers: int, cpus: list[int] | None):
        pin(cpus)
        torch.manual_seed(0)
        self.task, self.coordinator = task, coordinator
        self.policy = Policy(task)
        self.optim = torch.optim.Adam(self.policy.parameters(), lr=task.lr)
        self.sender = WeightSender(coordinator, expected_receivers=workers)
        self.timeline = Recorder("trainer")
        self.staged: dict[int, tuple[float, Any]] = {}
        self.digests: dict[int, str] = {}

    def stage(self, version: int, background: bool) -> None:
        # the tensors are the live parameters: nothing writes them before sync(version) returns
        named = {n: p.detach() for n, p in self.policy.named_parameters()}
        self.digests[version] = weights_digest(self.policy)
        start = time.time()
        handle = self.sender.stage(version, named, background=background)
        self.staged[version] = (start, handle)

    def train(self, step: int, max_staleness: int, background: bool, *batches: dict[str, Any]) -> dict[str, Any]:
        lags = [self.coordinator.check_batch(b["version"], step, max_staleness) for b in batches]
        start = time.time()
        tokens = torch.cat([b["tokens"] for b in batches])
        old_logp = torch.cat([b["logp"] for b in batches])
        rewards = torch.cat([b["reward"] for b in batches])
        pos = torch.arange(self.task.length)
        logits = self.policy(tokens[:, :-1], pos)
        logp = torch.log_softmax(logits, dim=-1).gather(2, tokens[:, 1:, None]).squeeze(2)
        # every token is rewarded on its own (no discount): the advantage is its reward
        # against the batch mean at that position
        advantage = rewards - rewards.mean(dim=0, keepdim=True)
        # batches one version old are slightly off-policy: weight them by the truncated
        # importance ratio current/behaviour policy
        ratio = (logp.detach() - old_logp).exp().clamp(max=2.0)
        loss = -(ratio * advantage * logp).mean()
        self.optim.zero_grad()
        loss.backward()
        self.optim.step()
        end = time.time()
        self.timeline.add("train", start, end)
        self.stage(step + 1, background)  # version step+1 = the weights after this step
        return {"loss": float(loss), "reward": float(rewards.mean()), "lags": lags, "train_s": end - start,
                "batches": [{"worker": b["worker"], "version": b["version"], "digest": b["digest"],
                             "reward": float(b["reward"].mean()), "gen_s": b["gen_s"]} for b in batches]}

    def sync(self, version: int) -> dict[str, Any]:
        start, handle = self.staged.pop(version)
        stage_s = handle.wait()
        self.timeline.add("stage", start, start + stage_s)
        packed = self.sender.transport.packed_bytes if hasattr(self.sender.transport, "packed_bytes") else None
        t0 = time.time()
        result = self.sender.sync(version)
        self.timeline.add("barrier", t0, time.time())
        after = self.sender.transport.packed_bytes if packed is not None else None
        return {"stage_s": stage_s, "barrier_s": result.barrier_s, "bytes": result.bytes,
                "packed_before_barrier": packed, "packed_after_barrier": after,
                "info_packed": result.metrics.info.get("packed_bytes")}

    def digest_of(self) -> dict[int, str]:
        return dict(self.digests)

    def spans(self) -> list[list[Any]]:
        return self.timeline.drain()

    def close(self) -> None:
        self.sender.close()


def split_cpus(pinned: bool) -> tuple[list[int] | None, list[int] | None]:
    """Trainer on the first half of the usable cores, rollouts on the second half."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if not pinned or len(cpus) < 2:
        return None, None
    half = len(cpus) // 2
    return cpus[:half], cpus[half:]


def run(mode: str, steps: int, task: Task = Task(), workers: int = 2, max_staleness: int = 1,
        pinned: bool = True, log=print) -> dict[str, Any]:
    """One training run in ``mode`` ("sync" or "one-step-off") on the running Ray cluster."""
    off = mode == "one-step-off"
    coordinator = Coordinator.create(SyncConfig(transport="shm", bucket_mb=1, max_staleness=max_staleness),
                                     name=f"one-step-off-{secrets.token_hex(4)}")
    trainer_cpus, rollout_cpus = split_cpus(pinned)
    rollouts = [Rollout.remote(coordinator, task, rank, rollout_cpus) for rank in range(workers)]
    trainer = Trainer.remote(coordinator, task, workers, trainer_cpus)
    share = task.batch // workers
    steps_out: list[dict[str, Any]] = []
    boundaries: list[float] = []
    try:
        def barrier(version: int) -> dict[str, Any]:
            t0 = time.time()
            *served, out = ray.get([r.apply.remote(version) for r in rollouts] + [trainer.sync.remote(version)])
            out.update(served=served, wall_s=time.time() - t0)
            return out

        ray.get(trainer.stage.remote(0, False))  # version 0: the initial weights
        barrier(0)
        pending = [r.generate.remote(share) for r in rollouts] if off else []
        last = time.time()
        for step in range(steps):
            if not off:
                pending = [r.generate.remote(share) for r in rollouts]
            # refs are handed on unresolved: the trainer waits for exactly the batches it needs
            train_ref = trainer.train.remote(step, max_staleness, off, *pending)
            if off and step + 1 < steps:
                # batch step+1 is generated with version `step`, while step `step` trains
                pending = [r.generate.remote(share) for r in rollouts]
            else:
                pending = []
            trained = ray.get(train_ref)
            if pending:
                ray.wait(pending, num_returns=len(pending))  # the barrier waits for generation
            sync = barrier(step + 1)
            now = time.time()
            steps_out.append({"step": step, "step_s": now - last, **trained, "sync": sync})
            boundaries.append(now)
            last = now
            tags = " ".join(f"{b['worker']}:v{b['version']}" for b in trained["batches"])
            log(f"[{mode}] step {step:2d}  {now - boundaries[0] if step else 0:6.2f}s  step {steps_out[-1]['step_s']:.3f}s"
                f"  train {trained['train_s']:.3f}s  gen {max(b['gen_s'] for b in trained['batches']):.3f}s"
                f"  stage {sync['stage_s'] * 1e3:5.1f}ms  barrier {sync['wall_s'] * 1e3:5.1f}ms"
                f"  batches [{tags}]  reward {trained['reward']:.3f}")
        spans = [Span.from_wire(row) for actor in [trainer, *rollouts] for row in ray.get(actor.spans.remote())]
        digests = ray.get(trainer.digest_of.remote())
    finally:
        try:
            ray.get([a.close.remote() for a in [trainer, *rollouts]], timeout=60)
        except (ray.exceptions.RayError, TimeoutError):
            pass  # an actor already died: its error is the one worth seeing
        for a in [trainer, *rollouts]:
            ray.kill(a)
        coordinator.shutdown()
    return {"mode": mode, "steps": steps_out, "spans": spans, "boundaries": boundaries, "digests": digests,
            "pinned": pinned and rollout_cpus is not None}


def summary(result: dict[str, Any], skip: int = 2) -> dict[str, float]:
    """Medians over the steps after the first ``skip`` (warm-up: allocator, first-touch)."""
    rows = result["steps"][skip:] or result["steps"]
    med = lambda key: statistics.median(key(r) for r in rows)  # noqa: E731
    first = statistics.mean(r["reward"] for r in result["steps"][:3])
    final = statistics.mean(r["reward"] for r in result["steps"][-3:])
    return {"step_s": med(lambda r: r["step_s"]), "train_s": med(lambda r: r["train_s"]),
            "gen_s": med(lambda r: max(b["gen_s"] for b in r["batches"])),
            "stage_s": med(lambda r: r["sync"]["stage_s"]), "barrier_s": med(lambda r: r["sync"]["wall_s"]),
            "barrier_frac": med(lambda r: r["sync"]["wall_s"] / r["step_s"]),
            "reward_first": first, "reward_last": final}


def window(result: dict[str, Any], first: int, count: int) -> tuple[list[Span], list[float]]:
    """Spans of steps [first, first+count): between the end of step first-1 and of the last."""
    b = result["boundaries"]
    lo = b[first - 1] if first > 0 else min(s.start for s in result["spans"])
    hi = b[min(first + count, len(b)) - 1]
    spans = [s for s in result["spans"] if s.end > lo and s.start < hi]
    return [Span(s.actor, s.phase, max(s.start, lo), min(s.end, hi)) for s in spans], [x for x in b if lo < x <= hi]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30, help="training steps per mode (default 30)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 8 steps, smaller batches")
    parser.add_argument("--mode", choices=["both", "sync", "one-step-off"], default="both")
    parser.add_argument("--max-staleness", type=int, default=1)
    parser.add_argument("--no-pin", action="store_true", help="do not pin trainer and rollouts to separate cores")
    parser.add_argument("--png", default="one_step_off_timeline.png", help="timeline picture ('' for none)")
    parser.add_argument("--json", default="", help="also write the per-step figures here")
    for field in dataclasses.fields(Task):
        parser.add_argument(f"--{field.name}", type=field.type if callable(field.type) else type(field.default),
                            default=None, help=f"task size (default {field.default})")
    args = parser.parse_args(argv)
    task = Task(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Task) if getattr(args, f.name) is not None})
    steps = args.steps
    if args.quick:
        steps = min(steps, 8)
        task = QUICK_TASK
    modes = ["sync", "one-step-off"] if args.mode == "both" else [args.mode]

    ray.init(include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        results = {m: run(m, steps, task, max_staleness=args.max_staleness, pinned=not args.no_pin) for m in modes}
    finally:
        ray.shutdown()
        reap_stale()  # segments of an actor that was killed (e.g. by Ray's memory monitor)

    print(f"\nload average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; task {task}")
    sums = {m: summary(r) for m, r in results.items()}
    for m, s in sums.items():
        print(f"{m:>13}: step {s['step_s']:.3f}s (median)  train {s['train_s']:.3f}s  generate {s['gen_s']:.3f}s  "
              f"stage {s['stage_s'] * 1e3:.1f}ms  barrier {s['barrier_s'] * 1e3:.1f}ms "
              f"({100 * s['barrier_frac']:.1f}% of the step)  reward {s['reward_first']:.3f} -> {s['reward_last']:.3f}")
    if len(sums) == 2:
        ratio = sums["one-step-off"]["step_s"] / sums["sync"]["step_s"]
        print(f"one-step-off / sync step time: {ratio:.2f}")
    if args.png:
        first = steps // 3 if steps >= 15 else (2 if steps > 6 else 0)  # steady state, past warm-up
        panels = []
        for m, r in results.items():
            spans, bounds = window(r, first, min(5, steps - first))
            panels.append((f"{m}: steps {first}-{first + len(bounds) - 1}, median step {sums[m]['step_s']:.2f}s", spans, bounds))
        why = render_png(panels, args.png, title="trainer and rollout workers: who is busy when",
                         actors=["trainer"] + [f"rollout-{i}" for i in range(2)])
        print(f"timeline: {args.png}" if why is None else f"no timeline: {why}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({m: {"summary": sums[m], "steps": [{k: v for k, v in s.items()} for s in r["steps"]]}
                       for m, r in results.items()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
