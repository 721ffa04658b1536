"""The ipc ring (ipc/ring.py: RingWriter.send and RingReader.receive) on the simulated accelerator, in one
process: a sender and two receivers, each on a stream of its own whose copies, digests and
loads complete 0 .. lag ms late in a seeded order. Tensors span buckets (the sender asks for
bucket b + 1's buffer before bucket b is handed out), the case that hung on a real GPU: every
run must commit both versions bit-exactly, whatever order the events complete in."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import weightsync_sim as sim
from support.parties import same_bits
from weightsync_bench.layouts import materialize

from weightsync.config import SyncConfig
from weightsync.device import resolve
from weightsync.digest import verify
from weightsync.manifest import Manifest, Packer, TensorSpec, Unpacker, plan_buckets
from weightsync.transports import Deadline, TransportContext
from weightsync.transports.ipc.records import IpcVersion
from weightsync.transports.ipc.transport import IpcReceiver, IpcSender

pytestmark = pytest.mark.sim

# 4 KiB buckets: "big" spans five, "mid" two; the small ones share buckets
MANIFEST = Manifest((TensorSpec("head", "float32", (300,)), TensorSpec("big", "float32", (4608,)),
                     TensorSpec("mid", "bfloat16", (3000,)), TensorSpec("tail", "int8", (700,))))
BUCKET_MB = 4096 / 2**20
SEEDS = 100  # per lag: 200 seeded runs in all


def _receive(r: IpcReceiver, version: int, wire: dict, params: dict, unpacker: Unpacker, seed: int, lag: float,
             errors: list) -> None:
    stream = sim.Stream(seed=f"r{r.ctx.name}:{seed}", lag_ms=lag)
    try:
        with sim.stream(stream):
            record = IpcVersion.from_wire(wire)
            for b, buf, expected, *_ in r.receive(version, record, Deadline(version, time.monotonic() + 20)):
                if expected is not None:
                    verify(r.ring.digest_kind, b, buf, expected, version)
                for name, t in unpacker.unpack(b, buf):
                    params[name].copy_(t)  # the engine's load: queued on this stream, lands late
    except BaseException as exc:
        errors.append(f"{r.ctx.name}: {type(exc).__name__}: {exc}")
    finally:
        stream.close()


def _run(seed: int, lag: float) -> list[str]:
    """One sender and two receivers through two versions: what went wrong, or nothing."""
    device = resolve("sim")
    cfg = SyncConfig(bucket_mb=BUCKET_MB, device="sim", align_bytes=64)
    plan = plan_buckets(MANIFEST, cfg.bucket_bytes, cfg.align_bytes)
    ctx = TransportContext(config=cfg, plan=plan, manifest=MANIFEST, digest=MANIFEST.digest(), session="t",
                           name="trainer-0", rank=0, device=device)
    with contextlib.ExitStack() as closing:  # whatever fails, nothing of the run outlives it
        stream = sim.Stream(seed=f"s:{seed}", lag_ms=lag)
        closing.callback(stream.close)
        sender = IpcSender(ctx)
        closing.callback(sender.close)
        receivers = []
        for i in range(2):
            receivers.append(IpcReceiver(dataclasses.replace(ctx, name=f"rollout-{i}"), sender.session))
            closing.callback(receivers[-1].close)
        models = [{s.name: torch.zeros(s.shape, dtype=s.torch_dtype, device=device) for s in MANIFEST}
                  for _ in receivers]
        unpackers = [Unpacker(plan, MANIFEST) for _ in receivers]
        for version in (1, 2):
            named = materialize(MANIFEST, seed=version, device=str(device))
            errors: list[str] = []
            with sim.stream(stream):
                wire = sender.stage(version, 0, Packer(plan, MANIFEST, named)).to_wire()
                threads = [threading.Thread(target=_receive, args=(r, version, wire, m, u, seed, lag, errors))
                           for r, m, u in zip(receivers, models, unpackers)]
                for t in threads:
                    t.start()
                try:
                    sender.send(version, Deadline(version, time.monotonic() + 20))
                except BaseException as exc:
                    errors.append(f"sender: {type(exc).__name__}: {exc}")
                for t in threads:
                    t.join(30)
            if errors:
                return errors
            want = materialize(MANIFEST, seed=version)
            if not all(same_bits(m[n].cpu(), want[n]) for m in models for n in want):
                return [f"version {version} is not bit-exact"]
        return []


def test_the_manifest_splits_tensors_over_buckets():
    plan = plan_buckets(MANIFEST, int(BUCKET_MB * 2**20), 64)
    assert [len(p) for p in plan.tensor_slices] == [1, 5, 3, 1]


def _runs(lag: float, seeds: list[int]) -> dict[int, list[str]]:
    return {seed: _run(seed, lag) for seed in seeds}


def _child() -> None:
    """In a child: ``python -c ... LAG SEED,SEED,...``; what went wrong per seed, as JSON."""
    lag, seeds = float(sys.argv[1]), [int(s) for s in sys.argv[2].split(",")]
    print(json.dumps(_runs(lag, seeds)))


@pytest.mark.parametrize("lag", [0.3, 2.0])
def test_the_ring_commits_whatever_order_events_complete_in(lag):
    # a run keeps a core busy (the simulated device's dispatch in Python; its threads share one
    # GIL, so eight at a time in one process took as long as one after another): the seeds go to
    # one plain child process per core (not multiprocessing, whose resource tracker would outlive
    # the run), each importing this module afresh
    procs = max(1, min(4, os.cpu_count() or 1))
    shares = [list(range(SEEDS))[i::procs] for i in range(procs)]
    children = [subprocess.Popen([sys.executable, "-c", "import test_sim_ring as t; t._child()", str(lag),
                                  ",".join(map(str, share))], cwd=Path(__file__).resolve().parent,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for share in shares]
    outcomes: dict[int, list[str]] = {}
    try:
        for child in children:
            out, err = child.communicate(timeout=600)
            assert child.returncode == 0, err[-3000:]
            outcomes.update({int(seed): errors for seed, errors in json.loads(out.strip().splitlines()[-1]).items()})
    finally:  # a child past its deadline, or left behind by a failed one, must not outlive the test
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
    assert len(outcomes) == SEEDS and {seed: errors for seed, errors in outcomes.items() if errors} == {}
