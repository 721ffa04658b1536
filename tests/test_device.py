"""The transports on one accelerator: trainer tensors and engine weights in device memory,
every party on the same device (the colocated case of verl's hybrid engine). Skipped
without the hardware; on a node with it: ``bash scripts/test.sh -m cuda`` (or ``-m npu``)."""

from __future__ import annotations

import pytest

from weightsync.device import ray_options
from weightsync.model_layouts import layout

# 30 KiB buckets: the 125 KiB embedding of "tiny" is split over five of them
CFG = {"bucket_mb": 0.03}
KINDS = [pytest.param("cuda", marks=pytest.mark.cuda), pytest.param("npu", marks=pytest.mark.npu)]


def _share(kind: str, parties: int) -> dict:
    # fractions of one device: Ray puts every party on the same one
    return ray_options(kind, 1 / parties)


# shm-stream: shm under a budget below two versions, a ring of host buffers read onto the device
@pytest.mark.parametrize("transport,chosen", [("auto", "ipc"), ("ipc", "ipc"), ("shm", "shm"), ("shm-stream", "shm")])
@pytest.mark.parametrize("kind", KINDS)
def test_colocated_on_one_device_bit_exact(start_job, kind, transport, chosen):
    m = layout("tiny")
    cfg = {**CFG, "device": kind, "transport": transport}
    if transport == "shm-stream":
        cfg.update(transport="shm", shm_budget_mb=0.2)
    on_device = {"device": kind}
    job = start_job(cfg, 2, m, options=_share(kind, 3), rollout=on_device, trainer=on_device)
    job.run(m, range(1, 6))
    status = job.coordinator.status()
    assert status["transport"] == chosen and status["latest_committed"] == 5
    assert ("shm streaming" in status["transport_reason"]) == (transport == "shm-stream")


@pytest.mark.parametrize("kind", KINDS)
def test_broadcast_refuses_two_ranks_on_one_device(ray_cluster, start_job, kind):
    # NCCL / HCCL cannot hold one device twice; the session says so instead of hanging
    ray = ray_cluster
    cfg = {**CFG, "device": kind, "transport": "broadcast", "connect_timeout_s": 30.0}
    on_device = {"device": kind}
    t = start_job(cfg, 1, options=_share(kind, 2), rollout=on_device, trainer=on_device).trainer
    with pytest.raises(ray.exceptions.RayTaskError, match="share physical"):
        ray.get(t.stage.remote(1), timeout=120)
