"""The ipc transport with real Ray actors: on CPU the bucket buffers are shared host storage,
the same protocol (handles, ready/released words, per-receiver slots) as on a device."""

from __future__ import annotations

import time

import pytest
import torch
from support.parties import assert_serves, rollout_actor
from weightsync_bench.layouts import layout, materialize

from weightsync import records
from weightsync.errors import ConfigError, ProtocolError, SyncFailed
from weightsync.transports.ipc.records import DeviceHandle
from weightsync.transports.ipc.support import DISABLE_IPC_VAR
from weightsync.transports.ipc.wire import import_handle, tag

# 30 KiB buckets: the 125 KiB embedding of "tiny" spans five buckets, more than the two
# ping-pong buffers, which is the case that needs buckets published before their tensor ends
SMALL = {"bucket_mb": 0.03, "device": "cpu"}


def _ipc_resources(status):
    return {k: v for k, v in status.resources.items() if k.startswith("ipc")}


def test_ipc_two_receivers_ten_versions_bit_exact(ray_cluster, start_job):
    ray = ray_cluster
    m = layout("tiny")
    job = start_job({**SMALL, "transport": "ipc"}, manifest=m)
    coord, rs, t = job
    for v in range(1, 11):
        applied, out = job.step(v)
        assert applied == [v, v]
        assert sorted(out.metrics.committed) == ["rollout-0", "rollout-1"]
        [assert_serves(x, m, v) for x in rs]
    status = coord.status()
    assert status.transport == "ipc"
    assert status.latest_committed == 10
    # sender: control block + 2 buffers; each receiver maps the same three
    assert _ipc_resources(status) == {"ipc_control": 3, "ipc_handles": 6}
    assert ray.get(rs[0].counters.remote()).post_loads == 10
    ray.get([a.close.remote() for a in rs + [t]])
    status = coord.status()
    assert _ipc_resources(status) == {"ipc_control": 0, "ipc_handles": 0}
    assert all(v == 0 for v in status.resources.values())


def _sender_here(coord, receivers):
    # the trainer side runs in the test process, so the environment switch applies to it only
    from weightsync.sender import WeightSender

    return WeightSender(coord, expected_receivers=receivers)


def test_auto_on_cpu_picks_shm_and_says_why(ray_cluster, coordinator_factory, actors):
    # host ipc works here, but on host memory auto prefers shm (rollback, catch-up); the
    # fallback for a device without IPC support is covered by tests/test_selection.py
    ray = ray_cluster
    m = layout("tiny")
    coord = coordinator_factory({**SMALL, "transport": "auto"})
    r = actors.add(rollout_actor(coord, m, "rollout-0"))
    with _sender_here(coord, 1) as sender:
        ref = r.apply.remote(1)
        sender.stage(1, materialize(m, seed=1))
        sender.sync(1)
        assert ray.get(ref) == 1
        [assert_serves(x, m, 1) for x in [r]]
        status = coord.status()
    assert status.transport == "shm"
    assert "host memory" in status.transport_reason


def test_explicit_ipc_that_cannot_work_fails_at_publish_with_the_reason(coordinator_factory, monkeypatch):
    m = layout("tiny")
    coord = coordinator_factory({**SMALL, "transport": "ipc"})
    monkeypatch.setenv(DISABLE_IPC_VAR, "1")
    with _sender_here(coord, 0) as sender:
        with pytest.raises(ConfigError, match=f"transport 'ipc' cannot run here: {DISABLE_IPC_VAR}"):
            sender.stage(1, materialize(m, seed=1))
    assert coord.status().transport is None


def test_sender_stops_waiting_for_a_receiver_declared_dead(ray_cluster, coordinator_factory, actors):
    ray = ray_cluster
    m = layout("tiny")
    coord = coordinator_factory({**SMALL, "transport": "ipc", "heartbeat_timeout_s": 2.0})
    rs = [actors.add(rollout_actor(coord, m, f"rollout-{i}", rank=i)) for i in range(2)]
    with _sender_here(coord, 2) as sender:
        refs = [r.apply.remote(1) for r in rs]
        sender.stage(1, materialize(m, seed=1))
        sender.sync(1)
        assert ray.get(refs) == [1, 1]
        # rollout-1 holds a receiver slot, then dies without releasing anything of version 2
        ray.kill(rs[1])
        live = rs[0].apply.remote(2)
        sender.stage(2, materialize(m, seed=2))
        t0 = time.monotonic()
        with pytest.raises(SyncFailed) as info:
            sender.sync(2)
        took = time.monotonic() - t0
    assert set(info.value.failed) == {"rollout-1"}
    assert "silent" in info.value.failed["rollout-1"]
    assert took < 20, f"the sender waited {took:.1f}s for a dead receiver (sync_timeout_s is 60)"
    assert ray.get(live) == 2  # the live receiver got every bucket of version 2
    [assert_serves(x, m, 2) for x in rs[:1]]


def test_receiver_refuses_handles_outside_the_allowlist():
    # the control plane carries handles as data; only known rebuild functions are ever called
    handle = dict(kind="cuda", physical=0, size=[4096], stride=[1], offset=0, typed=False, dtype="uint8",
                  handle=b"\x01" * 64, storage_bytes=4096, storage_offset=0, ref_handle=None, ref_offset=0,
                  event=None, event_sync=True)
    with pytest.raises(ProtocolError, match="unknown kind"):
        import_handle(DeviceHandle(**{**handle, "kind": "pickle"}))
    with pytest.raises(ProtocolError, match="ipc: DeviceHandle field 'physical' is str, not int"):
        DeviceHandle.from_wire({**handle, "physical": "0"})  # a handle's fields are checked where it arrives


def test_tags_order_buckets_within_and_across_versions():
    assert tag(1, 0) > tag(0, 5000) > tag(0, 1) > tag(0, 0) > 0
    assert tag(2**39 - 2, 2**24 - 1) < 2**64


_CHILD = """
import sys, torch
from weightsync import records
from weightsync.transports.ipc.records import DeviceHandle
from weightsync.transports.ipc.wire import import_handle
if sys.argv[1] == "npu":
    import torch_npu  # noqa: F401
t = import_handle(DeviceHandle.from_wire(records.decode(sys.stdin.buffer.read())))
print(int(t.view(torch.int32).sum().item()))
"""


def _roundtrip_in_child(kind: str):
    """Share a device buffer with a child process through our msgpack handle and read it back."""
    import subprocess
    import sys

    from weightsync.device import resolve
    from weightsync.transports.ipc.wire import export_handle

    dev = resolve(kind)
    t = torch.arange(4096, dtype=torch.int32, device=dev).view(torch.uint8)
    # a plain subprocess, not multiprocessing's spawn: that leaves its resource tracker running
    out = subprocess.run([sys.executable, "-c", _CHILD, kind], input=records.encode(export_handle(t).to_wire()),
                         capture_output=True, timeout=120, check=True)
    assert int(out.stdout) == int(t.view(torch.int32).sum().item())


@pytest.mark.cuda
def test_cuda_handle_roundtrip_through_msgpack():
    _roundtrip_in_child("cuda")


@pytest.mark.npu
def test_npu_handle_roundtrip_through_msgpack():
    _roundtrip_in_child("npu")
