"""Bounded shm: a budget below two whole versions makes the shm transport stream through a
ring of bucket buffers (transports/shm/transport.py). Real Ray actors, a real tmpfs.

The job's segments are files (shm_backing: files; the bound is the same for memfds, whose
sizes cannot be sampled by directory) in a directory of their own under /dev/shm, so the peak shared memory
measured is this job's alone (other runs on the machine use /dev/shm too): a thread samples the
sum of the allocated sizes (st_blocks) of every file in it, every millisecond, for the job's
whole life, segments being allocated once per session and kept until it closes.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading

import pytest
import ray
import torch
from faultjob import RECEIVERS, Job, sync_failed, wait_until
from weightsync_bench.layouts import layout

from weightsync import SyncConfig, transports
from weightsync.errors import CapacityError
from weightsync.manifest import plan_buckets
from weightsync.transports import TransportContext
from weightsync.transports.shm.transport import ShmSender, choose_mode
from weightsync.transports.shm.transport import layout as segment_layout

MANIFEST = layout("tiny")  # 7 buckets of 64 KiB at bucket_mb=1/16: one version is 412 KiB in a segment
BUCKET_MB = 1 / 16
BUDGET_MB = 0.25  # 256 KiB: below two versions; room for 3 buffers of 64 KiB beside the 36 KiB control block
BUDGET = int(BUDGET_MB * 2**20)


class Sampler(threading.Thread):
    """Peak bytes allocated by the files in ``directory``."""

    def __init__(self, directory: str):
        super().__init__(daemon=True)
        self.directory, self.peak, self.stop = directory, 0, threading.Event()

    def used(self) -> int:
        total = 0
        for name in os.listdir(self.directory):
            try:
                total += os.stat(os.path.join(self.directory, name)).st_blocks * 512
            except FileNotFoundError:
                pass  # closed between listdir and stat
        return total

    def run(self) -> None:
        while not self.stop.wait(0.001):
            self.peak = max(self.peak, self.used())


@pytest.fixture(scope="module")
def job(ray_cluster):
    directory = tempfile.mkdtemp(prefix="ws-stream-test-", dir="/dev/shm")
    sampler = Sampler(directory)
    sampler.start()
    j = Job("shm", MANIFEST, bucket_mb=BUCKET_MB, shm_budget_mb=BUDGET_MB, shm_dir=directory, shm_backing="files")
    j.sampler = sampler
    yield j
    j.close()
    sampler.stop.set()
    sampler.join()
    wait_until("the job's segments are gone", lambda: not sampler.used())
    shutil.rmtree(directory)


def _context(cfg: SyncConfig) -> TransportContext:
    plan = plan_buckets(MANIFEST, cfg.bucket_bytes, cfg.align_bytes)
    return TransportContext(config=cfg, plan=plan, manifest=MANIFEST, digest=MANIFEST.digest(), session="t",
                            name="trainer-0", rank=0, device=torch.device("cpu"))


def test_below_two_versions_it_streams_three_versions_bit_exact_within_the_budget(job):
    assert 2 * segment_layout(plan_buckets(MANIFEST, int(BUCKET_MB * 2**20), 256))[0] > BUDGET
    for _ in range(3):
        v = job.next()
        assert job.step(v) == {n: v for n in RECEIVERS}
        assert [job.serves(n) for n in RECEIVERS] == [v, v]
    status = job.coord.status()
    assert status.transport == "shm"
    assert ("shm streaming: whole versions need 1.21 MiB (3 x 412 KiB), budget 256 KiB (shm_budget_mb=0.25); "
            "ring of 3 x 64 KiB") in status.transport_reason, status.transport_reason
    assert 3 * 64 * 1024 <= job.sampler.peak <= BUDGET, job.sampler.peak


def test_a_late_joiner_gets_the_next_version_not_a_replay(job):
    base = job.fresh()
    job.kill("rollout-1")
    late = job.restart("rollout-1")  # registers with an empty model after base committed
    assert ray.get(late.apply.remote(None, None, False)) is None, "streaming keeps no version to replay"
    assert job.metrics(base).state == "COMMITTED"
    v = job.next()
    assert job.step(v) == {n: v for n in RECEIVERS} and [job.serves(n) for n in RECEIVERS] == [v, v]


@pytest.mark.scenario("fault", "receiver killed after bucket k of v, shm streaming (a budget below two versions)",
                      transport="shm", promise=(
    "rollout-1 killed while held mid-version: it is named failed, rollout-0 commits v and serves it; the restarted "
    "rollout-1 and rollout-0 both commit the next version"))
def test_a_receiver_killed_mid_version_is_named_and_the_next_version_commits(job):
    job.fresh()
    v = job.next()
    applied, sync = job.start_held(v, job.buckets // 2)
    job.kill("rollout-1")
    wait_until("rollout-1 is failed in v", lambda: "rollout-1" in job.metrics(v).failed)
    ray.get(job.rollouts["rollout-0"].release.remote())
    err = sync_failed(sync)
    assert set(err.failed) == {"rollout-1"} and err.committed == ["rollout-0"], err
    assert ray.get(applied["rollout-0"]) == v and job.serves("rollout-0") == v
    job.restart("rollout-1")
    v = job.next()
    assert job.step(v) == {n: v for n in RECEIVERS} and [job.serves(n) for n in RECEIVERS] == [v, v]


def test_the_default_budget_keeps_whole_versions():
    sender = transports.get("shm").sender(_context(SyncConfig(bucket_mb=BUCKET_MB, device="cpu")))
    try:
        assert type(sender) is ShmSender and sender.session.why.startswith("shm whole versions: 3 x 412 KiB")
    finally:
        sender.close()


def test_auto_budget_is_half_of_what_the_node_can_give():
    plan = _context(SyncConfig(bucket_mb=BUCKET_MB)).plan
    mode = choose_mode(plan, SyncConfig(bucket_mb=BUCKET_MB), capacity=lambda _config: 2 * BUDGET)
    assert (mode.streaming, mode.buffers) == (True, 3), mode


def test_a_budget_without_room_for_two_buckets_says_what_to_set():
    with pytest.raises(CapacityError) as err:
        transports.get("shm").sender(_context(SyncConfig(bucket_mb=BUCKET_MB, device="cpu", shm_budget_mb=0.1)))
    assert str(err.value) == (
        "shm: the budget of 102 KiB (shm_budget_mb=0.1) holds neither 3 whole versions (3 x 412 KiB) nor a ring "
        "of 2 bucket buffers of 64 KiB plus a 36 KiB control block: set shm_budget_mb >= 0.17, or a smaller "
        "bucket_mb")
