"""Broadcast transport: real Ray actors, a real gloo group built from our own store.

The device tests run the same flow over NCCL / HCCL; on a node with two or more devices:
    python -m pytest tests/test_broadcast.py -m cuda     # CUDA, backend nccl
    python -m pytest tests/test_broadcast.py -m npu      # Ascend, backend hccl
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import ray
import torch
from faultjob import RECEIVERS, Job, apply_fails, survivor_commits, sync_failed
from support.parties import assert_serves, trainer_actor
from weightsync_bench.layouts import layout

from weightsync.device import ray_options
from weightsync.errors import ConfigError, DeadlineExceeded
from weightsync.manifest import Manifest, TensorSpec
from weightsync.transports.broadcast.communicators import choose_backend, comm_device
from weightsync.transports.broadcast.groups import settle
from weightsync.transports.broadcast.transport import TRAILER, get_checksum, put_checksum

TINY = layout("tiny")  # embed_tokens is 125 KiB: several buckets of the size below
BUCKET_MB = 48 / 1024
CFG = {"transport": "broadcast", "bucket_mb": BUCKET_MB, "sync_timeout_s": 30.0, "device": "cpu"}


def test_plan_has_a_tensor_larger_than_a_bucket():
    from weightsync.config import SyncConfig
    from weightsync.manifest import plan_buckets

    plan = plan_buckets(TINY, SyncConfig(bucket_mb=BUCKET_MB).bucket_bytes)
    assert max(len(s) for s in plan.tensor_slices) >= 3
    assert plan.bucket_count >= 6


def test_backend_follows_device_and_refuses_a_mismatch():
    assert choose_backend("auto", torch.device("cpu")) == "gloo"
    assert choose_backend("auto", torch.device("cuda", 0)) == "nccl"
    npu = SimpleNamespace(type="npu", index=0)  # torch without torch_npu cannot name the device
    assert choose_backend("auto", npu) == "hccl"
    assert choose_backend("gloo", torch.device("cuda", 0)) == "gloo"
    assert comm_device("gloo", npu, "x") == torch.device("cpu")
    with pytest.raises(ConfigError, match="backend 'hccl' needs npu devices, but receiver 'r' runs on cpu"):
        comm_device("hccl", torch.device("cpu"), "receiver 'r'")


def test_checksum_trailer_round_trip():
    buf = torch.randint(0, 256, (1000 + TRAILER,), dtype=torch.uint8)
    value = put_checksum(buf, 1000)
    assert get_checksum(buf, 1000) == value
    buf[3] ^= 1
    assert put_checksum(buf, 1000) != value


class _TimedOutWork:
    """A collective whose own timeout (the deadline's remainder when it was posted) fired."""

    def __init__(self, when_done: float):
        self.when_done = when_done

    def is_completed(self) -> bool:
        return time.monotonic() >= self.when_done

    def wait(self) -> None:
        raise RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:129] Timed out waiting 2923ms for send operation")


def test_a_collective_timed_out_at_the_deadline_is_reported_as_the_deadline():
    """settle(): the op ends in gloo's timeout while poll() is still asking the coordinator,
    past the deadline; the reason is DeadlineExceeded, as when settle() sees the deadline first
    (what test_stuck_receiver_times_out_the_version promises), not the backend's RuntimeError."""
    # settle's first look (POLL_S, 0.25 s) finds it running; poll() then takes 0.5 s, during
    # which the deadline passes (0.5 s) and the op fails (0.6 s); the next look finds it done
    t0 = time.monotonic()
    with pytest.raises(DeadlineExceeded, match="bucket 0 of version 2 did not complete before the deadline"):
        settle(_TimedOutWork(t0 + 0.6), t0 + 0.5, lambda: time.sleep(0.5), "bucket 0 of version 2")
    # before the deadline the op's own error stands
    with pytest.raises(RuntimeError, match="Timed out"):
        settle(_TimedOutWork(0.0), time.monotonic() + 60, lambda: None, "bucket 0 of version 2")


def test_ten_versions_bit_exact_one_group(start_job, actors):
    """1 sender + 3 receivers + a non-sending trainer rank, 10 versions, bit-exact; the
    group is built once (epoch 1) and reused by every version."""
    coord, rollouts, sender = start_job(CFG, 3, TINY)
    follower = actors.add(trainer_actor(coord, TINY, CFG, rank=1))
    for v in range(1, 11):
        applied = [r.apply.remote(v) for r in rollouts]
        ray.get(sender.stage.remote(v), timeout=60)  # rank 1's sync needs the version to exist
        other = follower.step.remote(v)
        out = ray.get(sender.sync.remote(v), timeout=60)
        assert ray.get(applied, timeout=60) == [v, v, v]
        assert ray.get(other, timeout=60).version == v
        assert out.metrics.state == "COMMITTED"
        assert out.metrics.info["group"] == {"epoch": 1, "members": ["rollout-0", "rollout-1", "rollout-2"]}
        for r in rollouts:
            assert_serves(r, TINY, v)
    counters = ray.get([r.counters.remote() for r in rollouts])
    assert [c.post_loads for c in counters] == [10, 10, 10]
    status = coord.status()
    assert status.transport == "broadcast"
    assert status.group == {"backend": "gloo", "communicator": "torch",
                               "communicator_reason": "gloo: torch ProcessGroupGloo, its only construction"}
    assert status.resources["bcast_groups"] == 4  # one group per party, never rebuilt


# -- faults in the middle of a broadcast --------------------------------------------------
# A gloo sender runs at most two buckets plus the socket buffers ahead of its slowest member.
# With 56 MiB in 4 MiB buckets (far more than the buffers hold), members stopped at bucket k
# < last cannot have the rest of the version, whatever the timing: the outcome is decided by
# the fault point alone. The tiny model of test_faults.py fits in the buffers, so there a
# survivor could finish or not depending on the kernel; that is why these cases live here.
WIDE = Manifest((TensorSpec("embed", "bfloat16", (2048, 6144)),
                 *(TensorSpec(f"layers.{i}.w", "bfloat16", (1024, 2048)) for i in range(8))))


# what each case promises: docs/reliability.md shows it beside the outcome
RECEIVER_KILLED = ("first / middle bucket: the group breaks for everyone: the sender's SyncFailed names both "
                   "receivers, rollout-0's reason (and its own error) naming rollout-1 lost (silent); rollout-0 serves "
                   "v-1 at the first bucket (it holds only part of a tensor split over 6 buckets: nothing of v reached "
                   "the model) and nothing at the middle one (broadcast keeps no copy to roll back to) until the next "
                   "version; v ABORTED; last bucket: rollout-0 had every byte, so it is the shm / ipc outcome "
                   "(SyncFailed names only rollout-1, rollout-0 commits and serves v); either way the next version "
                   "re-forms the group without the dead member's old rank and commits on both")
SENDER_KILLED = ("first / middle bucket: both receivers raise naming trainer-0 (silent) and serve v-1 at the first "
                 "bucket (nothing of v reached the model yet) and nothing at the middle one until the next version; v "
                 "ABORTED; last bucket: every byte arrived, both serve v, while the coordinator, which aborted v when "
                 "the sender went silent, keeps v ABORTED with both listed committed; either way a restarted trainer's "
                 "next version commits on both")
RECEIVER_STUCK = ("known limit of a collective: the sender cannot tell which member is slow, so the version aborts at "
                  "the deadline for everyone with a reason naming the sender's timed-out bucket (DeadlineExceeded), "
                  "not the stuck rollout-1; both receivers raise and keep serving v-1 (bucket 0 holds only part of a "
                  "split tensor: nothing of v reached the model); v ABORTED; once unstuck, the next version (with a "
                  "deadline the engine fits in) commits on both")


@pytest.fixture(scope="module")
def job(ray_cluster):
    """One fault job over WIDE for the cases below (tests/faultjob.py)."""
    j = Job("broadcast", WIDE, bucket_mb=4.0)
    yield j
    j.close()


@pytest.mark.scenario("fault", "receiver killed after loading bucket k of v (first / middle / last)",
                      transport="broadcast", promise=RECEIVER_KILLED)
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_receiver_killed_at_bucket(job, where):
    base, v, applied, sync = job.kill_held("rollout-1", where)
    if where == "last":
        survivor_commits(job, v, applied["rollout-0"], sync, "silent")
    else:
        err = sync_failed(sync)
        assert "silent" in err.failed["rollout-1"], err
        assert set(err.failed) == set(RECEIVERS) and err.committed == []
        assert "lost receiver 'rollout-1'" in err.failed["rollout-0"], err.failed["rollout-0"]
        apply_fails(applied["rollout-0"], "lost receiver 'rollout-1'")
        assert job.serves("rollout-0") == (base if where == "first" else None)
    assert job.state(v) == "ABORTED"
    assert job.next_serves_all(restart="rollout-1")


@pytest.mark.scenario("fault", "sender killed after both receivers loaded bucket k of v (first / middle / last)",
                      transport="broadcast", promise=SENDER_KILLED)
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_sender_killed_at_bucket(job, where):
    base, v, applied, _ = job.kill_held("trainer", where)
    applied = list(applied.values())
    m = job.metrics(v)
    assert "trainer-0" in m.reason and "silent" in m.reason, m.reason
    if where == "last":
        assert ray.get(applied) == [v, v] and [job.serves(n) for n in RECEIVERS] == [v, v]
        assert sorted(job.metrics(v).committed) == list(RECEIVERS)
    else:
        for ref in applied:
            apply_fails(ref, "trainer-0", "silent")
        kept = base if where == "first" else None
        assert [job.serves(n) for n in RECEIVERS] == [kept, kept] and job.metrics(v).committed == []
    assert job.state(v) == "ABORTED"
    assert job.next_serves_all(restart="trainer")


@pytest.mark.scenario("fault", "receiver stuck in load_weights past the deadline (alive, heartbeating)",
                      transport="broadcast", promise=RECEIVER_STUCK)
def test_stuck_receiver_times_out_the_version(job):
    base = job.fresh()
    v, short = job.next(), 3.0
    applied, sync = job.start_held(v, 0, sync_timeout=short)  # only the sender's deadline is short
    applied = list(applied.values())
    ray.get(job.rollouts["rollout-0"].release.remote())  # rollout-0 goes on; rollout-1 stays stuck
    err = sync_failed(sync)
    assert set(err.failed) == set(RECEIVERS) and err.committed == []
    assert all("DeadlineExceeded" in why and "trainer-0" in why for why in err.failed.values()), err.failed
    ray.get(job.rollouts["rollout-1"].release.remote())
    for ref in applied:
        apply_fails(ref, f"version {v}")
    assert [job.serves(n) for n in RECEIVERS] == [base, base] and job.state(v) == "ABORTED"
    assert job.next_serves_all()


def _device_flow(start_job, kind: str, resources: dict):
    count = torch.cuda.device_count() if kind == "cuda" else torch.npu.device_count()
    if count < 2:
        pytest.skip(f"needs two {kind} devices (a communicator cannot hold one device twice)")
    job = start_job({**CFG, "device": kind, "bucket_mb": 1.0}, 1, TINY, options=resources)
    job.run(TINY, range(1, 4))
    assert job.coordinator.status().versions[-1].info["session"]["backend"] == ("nccl" if kind == "cuda" else "hccl")


@pytest.mark.cuda
def test_nccl_bit_exact(start_job):
    _device_flow(start_job, "cuda", ray_options("cuda", 1))


@pytest.mark.npu
def test_hccl_bit_exact(start_job):
    _device_flow(start_job, "npu", ray_options("npu", 1))
