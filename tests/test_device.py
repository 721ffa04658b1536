"""The transports on one accelerator: trainer tensors and engine weights in device memory,
every party on the same device (the colocated case of verl's hybrid engine), digests on and
off, several versions and two receivers bit-exact, a corrupted bucket and a killed receiver.
Skipped without the hardware; on a node with it: ``bash scripts/device_check.sh`` (or
``bash scripts/test.sh -m cuda`` / ``-m npu``). CI runs the same matrix on the simulated
accelerator (the sim tier: this matrix, test_sim_faults.py, test_sim_ring.py)."""

from __future__ import annotations

import pytest
from faultjob import sim_env
from weightsync_bench.layouts import layout

from weightsync.device import ray_options

# 30 KiB buckets: the 125 KiB embedding of "tiny" is split over five of them
CFG = {"bucket_mb": 0.03}
# sim: the simulated asynchronous accelerator (tests/sim/weightsync_sim), in CI's sim tier
KINDS = [pytest.param("cuda", marks=pytest.mark.cuda), pytest.param("npu", marks=pytest.mark.npu),
         pytest.param("sim", marks=pytest.mark.sim)]


def _share(kind: str, parties: int) -> dict:
    # fractions of one device: Ray puts every party on the same one (sim: events 0-20 ms late)
    return sim_env(0) if kind == "sim" else ray_options(kind, 1 / parties)


# shm-stream: shm under a budget below two versions, a ring of host buffers read onto the device.
# ipc is what auto chooses here, so ("auto", "ipc") runs ipc's device path; naming ipc explicitly
# is the transports' explicit rule, which test_selection.py checks without a job
@pytest.mark.parametrize("transport,chosen", [("auto", "ipc"), ("shm", "shm"), ("shm-stream", "shm")])
@pytest.mark.parametrize("digest", ["auto", "off"])
@pytest.mark.parametrize("kind", KINDS)
def test_colocated_on_one_device_bit_exact(start_job, kind, transport, chosen, digest):
    m = layout("tiny")
    cfg = {**CFG, "device": kind, "transport": transport, "digest": digest}
    if transport == "shm-stream":
        cfg.update(transport="shm", shm_budget_mb=0.2)
    on_device = {"device": kind}
    job = start_job(cfg, 2, m, options=_share(kind, 3), rollout=on_device, trainer=on_device)
    job.run(m, range(1, 4))  # the first attaches, the next two reuse every buffer and view
    status = job.coordinator.status()
    assert status.transport == chosen and status.latest_committed == 3
    assert ("shm streaming" in status.transport_reason) == (transport == "shm-stream")


@pytest.mark.parametrize("transport", ["ipc", "shm"])
@pytest.mark.parametrize("kind", KINDS)
def test_batched_loads_keep_every_nan_payload(start_job, kind, transport):
    """Random bits (NaNs with every payload among them) packed and loaded by batched copies
    (weightsync.CopyInto) on the device: bit for bit, though CUDA's batched copy of bf16 elements
    goes through float32, which keeps no NaN payload (the sim device does the same)."""
    m = layout("tiny")
    cfg = {**CFG, "device": kind, "transport": transport}
    on_device = {"device": kind}
    job = start_job(cfg, 2, m, options=_share(kind, 3), rollout={**on_device, "batched": True}, trainer=on_device)
    job.run(m, range(1, 4))
    assert job.coordinator.status().latest_committed == 3


@pytest.mark.parametrize("kind", KINDS)
def test_broadcast_refuses_two_ranks_on_one_device(ray_cluster, start_job, kind):
    # NCCL / HCCL cannot hold one device twice; the session says so instead of hanging
    ray = ray_cluster
    cfg = {**CFG, "device": kind, "transport": "broadcast", "connect_timeout_s": 30.0}
    on_device = {"device": kind}
    t = start_job(cfg, 1, options=_share(kind, 2), rollout=on_device, trainer=on_device).trainer
    with pytest.raises(ray.exceptions.RayTaskError, match="share physical"):
        ray.get(t.stage.remote(1), timeout=120)


# -- faults on the device: the scenarios of test_faults.py, every party on one device ----------

DEVICE_TRANSPORTS = ["shm", "ipc"]  # broadcast over NCCL / HCCL needs a device per rank
# on the simulated accelerator these are test_sim_faults.py's corrupted bucket and receiver killed
# at the middle bucket, the same functions on the same job: the sim tier runs them there
HARDWARE = [k for k in KINDS if k.values[0] != "sim"]


@pytest.fixture(scope="module", params=HARDWARE)
def device_kind(request):
    return request.param


@pytest.fixture(scope="module")
def transport(request):
    return request.param


@pytest.fixture(scope="module")
def job(ray_cluster, device_kind, transport):
    import test_faults
    from faultjob import Job

    j = Job(transport, test_faults.MANIFEST, bucket_mb=1 / 16, device=device_kind)
    yield j
    j.close()


@pytest.mark.parametrize("transport", DEVICE_TRANSPORTS, indirect=True)
def test_corrupted_bucket_on_the_device_is_not_applied(job, transport):
    import test_faults

    test_faults._tampered(job, transport, "corrupt", job.bucket_at("middle"))


@pytest.mark.parametrize("transport", DEVICE_TRANSPORTS, indirect=True)
def test_receiver_killed_mid_version_on_the_device(job):
    import test_faults

    test_faults.test_receiver_killed_at_bucket(job, "middle")


def test_device_check_says_why_it_checks_nothing_without_an_accelerator():
    import subprocess
    from pathlib import Path

    from weightsync.device import platform

    if platform() != "cpu":
        pytest.skip("an accelerator is here: scripts/device_check.sh would run the device tests")
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(["bash", "scripts/device_check.sh"], cwd=root, capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stderr.strip()) == (2, (
        "device_check: no accelerator here (platform: cpu); nothing to check. On CPU the device branches run on "
        "the simulated accelerator: bash scripts/tiers/sim.sh"))
