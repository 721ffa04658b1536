"""A job killed outright leaves nothing in RAM (memfd backing, the default where it works),
and a dead sender's versions stay reachable while any receiver holds them.

A real job (coordinator actor, trainer, two rollout workers) is held mid-version at a fault
point, then every one of its processes gets SIGKILL: no chance to close anything. Nothing of
weightsync runs after that (no reaper, no new party) before the checks, which read /proc only:
no live process holds a segment of the job, no segment file of it is in /dev/shm, and the
node's Shmem is back at its baseline.

Measure and tolerance: Shmem is node-wide, and other jobs on the node (another test run's
files-backed segments) move it by gigabytes while the test runs, so the test reads Shmem less
the files in /dev/shm: our memfds are in it, no file of the job is. What still moves that
figure (Ray's object store, tmpfs files elsewhere, memfds of other jobs) moved it by well
under 1 MiB on the development VM; 32 MiB absorbs it and is well below one segment of the job
(shm: a 256 MiB version slot; ipc: a 100 MiB bucket buffer), so a segment left behind cannot
hide in it.
"""

from __future__ import annotations

import os
import signal

import psutil
import pytest
import ray
from faultjob import RECEIVERS, Job, wait_until
from weightsync_bench.layouts import layout

from weightsync.manifest import Manifest, TensorSpec
from weightsync.transports.shm.transport import SEGMENT_NAME, SEGMENT_REF, holders, meminfo, our_segments

MANIFEST = Manifest(tuple(TensorSpec(f"layer{i}.weight", "bfloat16", (4096, 4096)) for i in range(8)))  # 256 MiB
BUCKET_MB = {"shm": 64, "ipc": 100}
# segments the job holds mid-version: shm: v-1's and v's version slots; ipc: control block + 2 buffers
SEGMENTS = {"shm": 2, "ipc": 3}
TOLERANCE = 32 * 2**20


def shmem() -> int:
    """The node's Shmem less the bytes of files in /dev/shm (see the module doc)."""
    total = meminfo("Shmem")
    files = 0
    for root, _, names in os.walk("/dev/shm"):
        for name in names:
            try:
                files += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                pass  # removed meanwhile
    return total - files


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE  # dead, its memory freed
    except psutil.NoSuchProcess:
        return True


@pytest.mark.scenario("fault", "every process of the job SIGKILLed mid-version (coordinator, trainer, receivers)",
                      promise="no process holds a segment of the job, no file of it is in /dev/shm, the node's "
                              "Shmem is back at its baseline (memfd backing; no reaper ran)")
@pytest.mark.parametrize("transport", ["shm", "ipc"])
@pytest.mark.alone  # the node's Shmem: the other xdist worker's memfds would move it by more than TOLERANCE
def test_killed_job_leaves_nothing_in_ram(ray_cluster, transport):
    files_before = set(our_segments())
    baseline = shmem()
    # a coordinator Ray would restart is a weightsync process running after the kill
    job = Job(transport, MANIFEST, BUCKET_MB[transport], shm_backing="memfd",
              coordinator_options={"max_restarts": 0, "max_task_retries": 0})
    try:
        job.fresh()
        job.start_held(job.next(), bucket=0)
        pids = {p.name: p.pid for p in job.coord.status().parties}
        pids["coordinator"] = ray.get(job.coord.actor.__ray_call__.remote(lambda _self: os.getpid()))
        assert len(pids) == 4, pids
        held = {(pid, fd, name) for pid, fd, name in holders() if pid in pids.values()}
        names = {name for _, _, name in held}
        assert len(names) == SEGMENTS[transport], f"the job holds {names}"
        size = {name: os.stat(f"/proc/{pid}/fd/{fd}").st_size for pid, fd, name in held}
        during = shmem() - baseline
        assert during >= 0.9 * sum(size.values()), f"Shmem grew by {during} bytes, the segments are {size}"

        for pid in pids.values():
            os.kill(pid, signal.SIGKILL)
        wait_until("every process of the job is gone", lambda: all(gone(pid) for pid in pids.values()))

        assert holders(names) == [], "no live process holds a segment of the job"
        mine = {f for f in set(our_segments()) - files_before if int(SEGMENT_NAME.match(f).group(1)) in pids.values()}
        assert mine == set(), f"segment files of the job in /dev/shm: {mine}"
        # the kernel frees a memfd with its last holder; poll briefly for the exit to finish
        # (and for another job's file caught between the two reads of shmem())
        wait_until("Shmem is back near its baseline", lambda: shmem() - baseline < TOLERANCE, 10, interval=0.2,
                   strict=False)
        after = shmem() - baseline
        assert after < TOLERANCE, (f"Shmem is {after / 2**20:.1f} MiB above its baseline after the kill "
                                   f"({during / 2**20:.1f} MiB while the job ran)")
    finally:
        job.close()


@pytest.mark.scenario("fault", "sender dead, a receiver restarted: catches up from a segment another receiver holds",
                      transport="shm", promise="the replacement finds the memfd through the surviving receiver "
                      "(/proc scan) and serves the latest committed version bit for bit; a restarted trainer's "
                      "next version commits on both")
def test_restarted_receiver_catches_up_through_another_holder(ray_cluster):
    job = Job("shm", layout("tiny"), 1 / 16, shm_backing="memfd")
    try:
        base = job.fresh()
        ref = job.metrics(base).info["segment"]
        job.kill("trainer")
        job.wait_seen("trainer-0", alive=False)
        job.kill("rollout-1")
        survivor = ray.get(job.rollouts["rollout-0"].pid.remote())
        name = SEGMENT_REF.match(ref).group(1)
        wait_until("only the surviving receiver holds the version", lambda: {
            pid for pid, _, _ in holders([name])} == {survivor})
        fresh = job.restart("rollout-1")
        assert ray.get(fresh.apply.remote(None, None, False)) == base
        assert job.serves("rollout-1") == base
        v = job.next()
        job.restart("trainer")
        assert job.step(v) == {n: v for n in RECEIVERS} and [job.serves(n) for n in RECEIVERS] == [v, v]
    finally:
        job.close()
