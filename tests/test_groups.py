"""Which construction builds the broadcast group, and why (weightsync.transports.broadcast.communicators).

The constructions themselves run in tests/test_broadcast.py (torch gloo here; nccl / hccl
on devices), tests/vllm_tier/test_stateless_group.py (vLLM's StatelessProcessGroup on our store)
and the npu / cuda tests below."""

from __future__ import annotations

import pytest
import ray
from weightsync_bench.layouts import layout

from weightsync.errors import ConfigError
from weightsync.transports.broadcast.communicators import choose_communicator, probe


def _probe(missing: dict[str, str]):
    return lambda name: missing.get(name)


def test_npu_auto_is_pyhccl_when_vllm_ascend_imports():
    name, why = choose_communicator("auto", "hccl", _probe({}))
    assert (name, why) == ("pyhccl", "auto on NPU: pyhccl, the construction verl >= 0.7 and vllm-ascend run on "
                                     "the user's stack")


def test_npu_auto_falls_back_to_torch_npu_and_says_why():
    name, why = choose_communicator("auto", "hccl", _probe({"pyhccl": "ModuleNotFoundError: No module named 'vllm_ascend'"}))
    assert name == "torch_npu"
    assert why == ("auto on NPU: torch_npu ProcessGroupHCCL; pyhccl not available "
                   "(ModuleNotFoundError: No module named 'vllm_ascend')")


def test_npu_with_neither_construction_is_an_error_naming_both():
    with pytest.raises(ConfigError, match="no 'hccl' group can be built here: pyhccl not available .*; torch_npu not"):
        choose_communicator("auto", "hccl", _probe({"pyhccl": "a", "torch_npu": "b"}))


def test_cuda_auto_is_torch_nccl_and_pynccl_on_request():
    assert choose_communicator("auto", "nccl", _probe({}))[0] == "torch"
    assert choose_communicator("pynccl", "nccl", _probe({})) == ("pynccl", "communicator: pynccl (set in the config)")


def test_explicit_choice_for_the_wrong_backend_names_the_right_ones():
    with pytest.raises(ConfigError, match="communicator 'pyhccl' does not build a 'nccl' group; backend 'nccl' takes "
                                          "torch or pynccl"):
        choose_communicator("pyhccl", "nccl", _probe({}))


def test_explicit_choice_that_cannot_be_built_here_says_why():
    # the real probe, in this process: no vllm-ascend on a CPU machine
    assert probe("pyhccl") is not None
    with pytest.raises(ConfigError, match="communicator 'pyhccl' cannot be built here: ModuleNotFoundError"):
        choose_communicator("pyhccl", "hccl")


def test_an_impossible_communicator_fails_at_registration(start_job):
    cfg = {"transport": "broadcast", "device": "cpu", "communicator": "pyhccl", "connect_timeout_s": 30.0}
    t = start_job(cfg, 1).trainer
    with pytest.raises(ray.exceptions.RayTaskError, match="communicator 'pyhccl' does not build a 'gloo' group"):
        ray.get(t.stage.remote(1), timeout=120)


def _device_count(kind: str) -> int:
    import torch

    from weightsync.device import device_count

    return device_count(kind) if kind != "cuda" else torch.cuda.device_count()


@pytest.mark.parametrize("kind,communicator", [
    pytest.param("npu", "pyhccl", marks=pytest.mark.npu), pytest.param("npu", "torch_npu", marks=pytest.mark.npu),
    pytest.param("cuda", "torch", marks=pytest.mark.cuda), pytest.param("cuda", "pynccl", marks=pytest.mark.cuda),
])
def test_each_device_construction_bit_exact(start_job, kind, communicator):
    """Every construction through the broadcast transport's one code path, 3 versions,
    bit-exact, the group built once. Needs two devices of the kind."""
    from weightsync.device import ray_options

    if _device_count(kind) < 2:
        pytest.skip(f"needs two {kind} devices (a communicator cannot hold one device twice)")
    if probe(communicator) is not None:
        pytest.skip(f"{communicator} cannot be built here: {probe(communicator)}")
    m = layout("tiny")
    cfg = {"transport": "broadcast", "device": kind, "communicator": communicator, "bucket_mb": 1.0,
           "sync_timeout_s": 60.0}
    job = start_job(cfg, 1, m, options=ray_options(kind, 1))
    job.run(m, range(1, 4))
    status = job.coordinator.status()
    assert status.group["communicator"] == communicator
    assert status.resources["bcast_groups"] == 2


def _gloo_listens(monkeypatch, ifname: str | None) -> set[str]:
    """Addresses the sockets of a new 2-rank gloo group listen on (ranks in two threads)."""
    import datetime
    import threading

    import psutil
    import torch.distributed as dist

    from weightsync.transports.broadcast.communicators import new_process_group

    if ifname is None:
        monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    else:
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", ifname)

    def listening() -> set[tuple[str, int]]:
        return {(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections("tcp")
                if c.status == psutil.CONN_LISTEN}

    before, store, groups = listening(), dist.HashStore(), []
    threads = [threading.Thread(target=lambda r=r: groups.append(
        new_process_group("gloo", store, r, 2, datetime.timedelta(seconds=20)))) for r in (0, 1)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert len(groups) == 2
    return {ip.removeprefix("::ffff:") for ip, _ in listening() - before}


def test_gloo_listens_on_the_ray_node_address_unless_gloo_socket_ifname_says(ray_cluster, monkeypatch):
    # gloo's default follows the hostname, often a loopback address other nodes cannot reach
    assert _gloo_listens(monkeypatch, None) == {ray.util.get_node_ip_address()}
    assert _gloo_listens(monkeypatch, "lo") == {"127.0.0.1"}
