"""Bad input: each is a clear error naming what is wrong, and nothing is applied."""

from __future__ import annotations

import os

import pytest
import ray
import torch
from support.parties import (
    assert_serves,
    new_coordinator,
    start_parties,
    stop_actors,
)
from weightsync_bench.layouts import layout, materialize

from weightsync import CapacityError, ConfigError, ManifestError, SyncConfig, VersionError
from weightsync.manifest import Manifest, Packer, TensorSpec, build_manifest, plan_buckets
from weightsync.transports import TransportContext
from weightsync.transports.shm.transport import ShmSender, holders, locate, memory_available

MANIFEST = layout("tiny")
CFG = {"transport": "shm", "bucket_mb": 1 / 16}


def _bad(kind: str) -> list:
    good = list(materialize(MANIFEST, seed=2).items())
    if kind == "unknown tensor name":
        good[5] = ("model.not_a_tensor", good[5][1])
    elif kind == "missing tensor":
        del good[-1]
    elif kind == "wrong shape":
        good[4] = (good[4][0], torch.zeros(3, 3, dtype=good[4][1].dtype))
    elif kind == "wrong dtype":
        good[4] = (good[4][0], good[4][1].float())
    elif kind == "duplicate names":
        good[6] = good[5]
    return good


PATTERNS = {
    "unknown tensor name": "unknown tensor 'model.not_a_tensor'",
    "missing tensor": "missing tensor",
    "wrong shape": "has shape",
    "wrong dtype": "has dtype float32",
    "duplicate names": "duplicate tensor name",
}


@pytest.fixture(scope="module")
def job(ray_cluster):
    """One coordinator, receiver and trainer for every bad-input case (each uses new versions)."""
    job = start_parties(new_coordinator(CFG, "ws-bad-input"), MANIFEST, CFG, 1)
    yield {"coord": job.coordinator, "rollout": job.rollouts[0], "trainer": job.trainer, "version": 0}
    stop_actors(job.parties)
    job.coordinator.shutdown()


@pytest.mark.parametrize("kind", list(PATTERNS))
@pytest.mark.parametrize("form", ["mapping", "iterable"])
def test_bad_tensors_on_the_sender(job, kind, form, request):
    request.node.add_marker(pytest.mark.scenario("bad input", f"{kind} ({form})"))
    coord, r, trainer = job["coord"], job["rollout"], job["trainer"]
    good, bad_version = job["version"] + 1, job["version"] + 2
    job["version"] += 2
    applied = r.apply.remote(good)
    ray.get(trainer.step.remote(good, 1))
    assert ray.get(applied) == good
    bad = _bad(kind)
    if form == "mapping" and kind != "duplicate names":  # a dict cannot hold a duplicate
        bad = dict(bad)
    applied = r.apply.remote(bad_version)
    with pytest.raises(ManifestError, match=PATTERNS[kind]):
        ray.get(trainer.stage.remote(bad_version, None, 0.0, bad))
    with pytest.raises(VersionError, match="aborted.*ManifestError"):
        ray.get(applied)
    assert_serves(r, materialize(MANIFEST, seed=1), good)  # nothing of the bad version was applied
    assert coord.metrics(bad_version).state == "ABORTED"


@pytest.mark.scenario("bad input", "bucket truncated in transit")
@pytest.mark.parametrize("backing", ["files", "memfd"])
def test_truncated_segment_is_refused(start_job, backing):
    """files: the receiver sees the cut file and refuses the version (no SIGBUS), serving v1;
    memfd: the segment is sealed against shrinking, the cut is refused and v2 commits."""
    job = start_job({**CFG, "shm_backing": backing}, 1, MANIFEST)
    coord, (r,), trainer = job
    job.step(1)
    ray.get(trainer.stage.remote(2))
    path = locate(coord.metrics(2).info["segment"], "/dev/shm")
    if backing == "files":
        os.truncate(path, os.path.getsize(path) // 2)
        with pytest.raises(Exception, match="truncated"):
            ray.get(r.apply.remote(2))
        assert ray.get(r.version.remote()) == 1, "the receiver survived (no SIGBUS) and serves version 1"
        return
    with pytest.raises(PermissionError):  # F_SEAL_SHRINK
        os.truncate(path, os.path.getsize(path) // 2)
    applied = r.apply.remote(2)
    ray.get(trainer.sync.remote(2))
    assert ray.get(applied) == 2
    assert_serves(r, MANIFEST, 2)


@pytest.mark.scenario("bad input", "config with unknown keys or impossible values")
@pytest.mark.parametrize("bad,pattern", [
    ({"bucket_sizee": 1}, "unknown weightsync config key 'bucket_sizee'"),
    ({"bucket_mb": 1e-5, "align_bytes": 256}, "smaller than align_bytes"),
    ({"sync_timeout_s": -1}, "sync_timeout_s must be a positive"),
    ({"transport": "carrier-pigeon"}, "transport must be one of"),
])
def test_bad_config(bad, pattern):
    with pytest.raises(ConfigError, match=pattern):
        SyncConfig.from_mapping(bad)


@pytest.mark.scenario("bad input", "manifest too large for the shm space left")
@pytest.mark.parametrize("backing", ["files", "memfd"])
def test_manifest_too_large_for_shm_is_refused_before_writing(backing):
    if backing == "files":
        free = os.statvfs("/dev/shm").f_bavail * os.statvfs("/dev/shm").f_frsize
        message = r"needs \d+\.\d MiB in /dev/shm but only \d+\.\d MiB are free"
    else:  # /dev/shm's size does not bound a memfd: the memory the kernel can give does
        free = memory_available()[0]
        message = r"needs \d+\.\d MiB of memory \(memfd\) but only \d+\.\d MiB are available \((MemAvailable|the memory cgroup)"
    huge = Manifest((TensorSpec("w", "uint8", (free + (1 << 30),)),))
    # a budget that lets whole versions through (by default this manifest streams instead): the
    # segment itself is refused by the space check
    cfg = SyncConfig(bucket_mb=64, shm_backing=backing, shm_budget_mb=4 * (free + (1 << 30)) / 2**20)
    ctx = TransportContext(config=cfg, plan=plan_buckets(huge, cfg.bucket_bytes, cfg.align_bytes), manifest=huge,
                           digest=huge.digest(), session="t", name="trainer-0", rank=0, device=torch.device("cpu"))
    sender = ShmSender(ctx)
    # this process's files only (a segment's name carries its creator's pid): another test, run
    # beside this one under xdist, may create or remove its own meanwhile
    def created() -> set[str]:
        return {n for n in os.listdir("/dev/shm") if n.startswith(f"wsync_{os.getpid()}_")}

    before = created()
    with pytest.raises(CapacityError, match=message):
        sender.stage(1, 0, Packer(ctx.plan, huge, iter(())))
    assert created() == before, "no file was created"
    assert [h for h in holders() if h[0] == os.getpid()] == [], "no memfd was created"
    sender.close()


@pytest.mark.scenario("bad input", "non-contiguous tensors on the sender (accepted, bit-exact)")
def test_non_contiguous_inputs_are_sent_bit_exact(start_job):
    weights = {n: t for n, t in materialize(MANIFEST, seed=3).items()}
    # the same values, held transposed-and-back or sliced: strided views on the sender
    strided = {n: (t.t().contiguous().t() if t.dim() == 2 else t[::1]) for n, t in weights.items()}
    assert any(not t.is_contiguous() for t in strided.values())
    _, (r,), trainer = start_job(CFG, 1, MANIFEST)
    applied = r.apply.remote(3)
    ray.get(trainer.stage.remote(3, None, 0.0, list(strided.items())))
    ray.get(trainer.sync.remote(3))
    assert ray.get(applied) == 3
    assert_serves(r, weights, 3)


@pytest.mark.scenario("bad input", "DTensor-like input on the sender")
def test_dtensor_like_input_is_refused():
    class ShardedLike:
        shape, dtype, placements = (4,), torch.float32, ("Shard(0)",)

        def full_tensor(self):
            raise AssertionError("must not be called behind the user's back: it is a collective")

    with pytest.raises(ManifestError, match="DTensor .*full_tensor"):
        build_manifest([("w", ShardedLike())])
