"""Transport choice (pure) and the capability rules behind it (versions read from real files)."""

from __future__ import annotations

import pytest
import torch

from weightsync.device import local_index, physical_index
from weightsync.errors import ConfigError
from weightsync.records import Device, IpcSupport, Placement
from weightsync.transports import COLOCATED, REMOTE, SAME_NODE, placement
from weightsync.transports import choose as choose_transport
from weightsync.transports.ipc import support as caps

OK = IpcSupport(ok=True, reason="ipc fine")
NO = IpcSupport(ok=False, reason="CANN 8.2.RC1 is older than 8.3.RC1")


def party(host="h1", kind="cpu", physical=None, ipc=None, name=None, node=None, rank=0):
    return Placement(host=host, device=Device(type=kind, index=0 if kind != "cpu" else None, physical=physical),
                     node_id=node or "", ipc=ipc, name=name or "", rank=rank)


# -- placement and auto ------------------------------------------------------------------

def test_placement_compares_host_then_physical_device():
    s = party(kind="npu", physical=3)
    assert placement(s, party(kind="npu", physical=3)) == COLOCATED
    assert placement(s, party(kind="npu", physical=4)) == SAME_NODE
    assert placement(s, party(host="h2", kind="npu", physical=3)) == REMOTE
    assert placement(party(), party()) == COLOCATED  # host memory: one node is one device


def test_placement_is_by_ray_node_id_and_by_host_only_without_one():
    # several raylets on one machine (a simulated cluster) share an address, not a /dev/shm view
    a, b = party(node="aaaa1111aaaa"), party(node="bbbb2222bbbb")
    assert placement(a, b) == REMOTE
    assert placement(a, party(host="h2", node="aaaa1111aaaa")) == COLOCATED  # one node, two addresses
    assert placement(party(kind="npu", physical=0, node="n1"), party(kind="npu", physical=0, node="n2")) == REMOTE
    assert placement(a, party()) == COLOCATED  # no node id on one side (no Ray): the host decides
    assert placement(party(), party(host="h2")) == REMOTE


def test_auto_across_ray_nodes_on_one_address_picks_relay_naming_them():
    s = party(host="10.0.0.1", node="aaaa1111" * 7, ipc=OK)
    far = [party(host="10.0.0.1", node="bbbb2222" * 7, name="rollout-0"),
           party(host="10.0.0.1", node="cccc3333" * 7, name="rollout-1")]
    name, reason = choose_transport("auto", s, far)
    assert name == "relay"
    assert reason == ("auto: 2 receiver(s) (rollout-0, rollout-1) on other nodes (10.0.0.1 (node bbbb2222), "
                      "10.0.0.1 (node cccc3333)); relay: one copy per receiving node, passed on from node to node, "
                      "read by the other receivers of a node from its shared memory")
    with pytest.raises(ConfigError, match=r"1 receiver\(s\) \(rollout-1\) on 10.0.0.1 \(node cccc3333\) are not"):
        choose_transport("shm", s, [party(host="10.0.0.1", node="aaaa1111" * 7), far[1]])
    # the same receivers on the sender's node: shm
    assert choose_transport("auto", s, [party(host="10.0.0.1", node="aaaa1111" * 7)] * 2)[0] == "shm"


def test_auto_mixed_placement_relays_across_nodes_and_the_senders_node_reads_the_senders_copy():
    s = party(node="n-a", ipc=OK)
    name, reason = choose_transport("auto", s, [party(node="n-a", name="local-0"), party(node="n-b", name="far-0")])
    assert name == "relay"
    assert "1 receiver(s) (far-0) on other nodes" in reason
    assert "(1 receiver(s) (local-0) on the sender's node read the sender's)" in reason
    # on a device the collective's ring relays: broadcast, and the sender's node's receivers are in it
    name, reason = choose_transport("auto", party(kind="cuda", physical=0, node="n-a", ipc=OK),
                                    [party(kind="cuda", physical=1, node="n-a", name="local-0"),
                                     party(kind="cuda", physical=0, node="n-b", name="far-0")])
    assert name == "broadcast" and "also reaches 1 receiver(s) (local-0) on the sender's node" in reason


def test_one_device_twice_is_per_ray_node():
    # physical device 0 on two Ray nodes is two devices, even behind one address
    s = party(kind="cuda", physical=0, node="n-a")
    assert choose_transport("broadcast", s, [party(kind="cuda", physical=0, node="n-b")])[0] == "broadcast"
    with pytest.raises(ConfigError, match=r"share physical cuda 0 on h1 \(node n-a\)"):
        choose_transport("broadcast", s, [party(kind="cuda", physical=0, node="n-a"),
                                          party(kind="cuda", physical=1, node="n-a")])


def test_auto_colocated_with_ipc_picks_ipc():
    name, reason = choose_transport("auto", party(kind="cuda", physical=1, ipc=OK),
                                    [party(kind="cuda", physical=1), party(kind="cuda", physical=1)])
    assert name == "ipc" and "shares the sender's device" in reason


def test_auto_on_host_memory_picks_shm_even_where_host_ipc_works():
    name, reason = choose_transport("auto", party(ipc=OK), [party(), party()])
    assert name == "shm" and "host memory" in reason and "rollback" in reason
    assert choose_transport("ipc", party(ipc=OK), [party()])[0] == "ipc"  # still there when asked for


def test_auto_colocated_without_ipc_falls_back_to_shm_and_says_why():
    name, reason = choose_transport("auto", party(kind="npu", physical=0, ipc=NO), [party(kind="npu", physical=0)])
    assert name == "shm"
    assert "CANN 8.2.RC1 is older than 8.3.RC1" in reason and "fell back to shm" in reason


def test_auto_same_node_other_devices_picks_broadcast_on_accelerators():
    name, reason = choose_transport("auto", party(kind="npu", physical=0, ipc=OK),
                                    [party(kind="npu", physical=2, name="r0"), party(kind="npu", physical=1, name="r1")])
    assert name == "broadcast" and "r1" in reason and "npu collective" in reason


def test_a_device_collective_never_gets_one_device_twice():
    # NCCL / HCCL cannot put two ranks on one device (NCCL: "Duplicate GPU detected", or a hang)
    s = party(kind="cuda", physical=0, ipc=OK)
    mixed = [party(kind="cuda", physical=0, name="r0"), party(kind="cuda", physical=1, name="r1")]
    name, reason = choose_transport("auto", s, mixed)
    assert name == "shm" and "the sender and receiver 'r0' share physical cuda 0" in reason
    with pytest.raises(ConfigError, match="receiver 'r0' share physical cuda 0.*use 'ipc'"):
        choose_transport("broadcast", s, mixed)
    twins = [party(kind="cuda", physical=3, name="a"), party(kind="cuda", physical=3, name="b")]
    with pytest.raises(ConfigError, match="receiver 'a' and receiver 'b' share physical cuda 3"):
        choose_transport("broadcast", s, twins)
    with pytest.raises(ConfigError, match="share physical cuda 0"):
        choose_transport("auto", s, mixed + [party(host="h2", kind="cuda", physical=0)])
    # gloo stages through host memory: sharing a device is fine; so are other hosts' devices
    assert choose_transport("broadcast", s, mixed, backend="gloo")[0] == "broadcast"
    assert choose_transport("broadcast", s, [party(host="h2", kind="cuda", physical=0)])[0] == "broadcast"


def test_auto_same_node_cpu_without_device_collective_picks_shm():
    # a CPU sender with receivers on accelerators of the node: no shared device collective
    name, _ = choose_transport("auto", party(ipc=OK), [party(kind="cuda", physical=0)])
    assert name == "shm"


def test_auto_across_nodes_relays_host_memory_and_broadcasts_on_a_device():
    for kind, phys, other, want in (("cpu", None, None, "relay"), ("cuda", 0, 1, "broadcast")):
        name, reason = choose_transport("auto", party(kind=kind, physical=phys, ipc=OK),
                                        [party(kind=kind, physical=other), party(host="h2", kind=kind, physical=phys)])
        assert name == want and "other nodes" in reason
    with pytest.raises(ConfigError, match="transport 'relay' moves host memory over gloo"):
        choose_transport("relay", party(kind="cuda", physical=0, ipc=OK), [party(host="h2", kind="cuda", physical=0)])


def test_auto_without_registered_receivers_picks_what_serves_late_joiners():
    assert choose_transport("auto", party(ipc=OK), [])[0] == "shm"
    name, reason = choose_transport("auto", party(kind="npu", physical=0, ipc=OK), [])
    assert name == "broadcast" and "expected_receivers" in reason


# -- explicit choices --------------------------------------------------------------------

def test_explicit_ipc_needs_support_on_the_sender():
    with pytest.raises(ConfigError, match="transport 'ipc' cannot run here: CANN 8.2.RC1"):
        choose_transport("ipc", party(ipc=NO), [party()])


def test_explicit_ipc_needs_every_receiver_on_the_sender_device():
    s = party(kind="npu", physical=2, ipc=OK)
    with pytest.raises(ConfigError, match=r"use another device") as info:
        choose_transport("ipc", s, [party(kind="npu", physical=2), party(kind="npu", physical=5, name="rollout-7")])
    assert "rollout-7" in str(info.value) and "physical npu 2" in str(info.value)
    with pytest.raises(ConfigError, match="run on another node"):
        choose_transport("ipc", s, [party(host="h9", kind="npu", physical=2)])
    with pytest.raises(ConfigError, match="expected_receivers"):
        choose_transport("ipc", s, [])
    assert choose_transport("ipc", s, [party(kind="npu", physical=2)])[0] == "ipc"


def test_explicit_shm_across_nodes_fails_and_broadcast_always_passes():
    with pytest.raises(ConfigError, match="h2"):
        choose_transport("shm", party(), [party(host="h2")])
    assert choose_transport("broadcast", party(), [party(host="h2")]) == (
        "broadcast", "transport 'broadcast' requested by config")


# -- capability rules ----------------------------------------------------------------------

@pytest.mark.parametrize("older,newer", [
    ("8.3.RC1", "8.3.0"), ("8.2.RC1.alpha003", "8.2.RC1"), ("8.2.RC1", "8.3.RC1"), ("24.1.rc2", "25.3.RC1"),
    ("25.3.rc1", "25.3.0"), ("2.7.1", "2.7.1.post2"), ("2.1.0.post13", "2.1.0.post17"), ("2.9.0rc1", "2.9.0"),
])
def test_versions_order_like_ascend_releases(older, newer):
    assert caps.parse_version(older) < caps.parse_version(newer)


def test_version_spelling_does_not_matter_and_junk_is_rejected():
    assert caps.parse_version("25.3.rc1") == caps.parse_version("25.3.RC1")
    assert caps.parse_version("not a version") is None
    assert not caps.at_least(None, "8.3.RC1")


def test_npu_ipc_rules_each_give_their_reason():
    good = ("25.3.rc1", "8.3.RC1", "2.7.1")
    assert caps.npu_ipc_support(*good).ok
    cases = {
        (None, "8.3.RC1", "2.7.1"): "driver (HDK) version unknown",
        ("25.2.0", "8.3.RC1", "2.7.1"): "HDK 25.2.0 is older than 25.3.RC1",
        ("25.3.rc1", None, "2.7.1"): "CANN version unknown",
        ("25.3.rc1", "8.2.RC1", "2.7.1"): "CANN 8.2.RC1 is older than 8.3.RC1",
        ("25.3.rc1", "8.3.RC1", None): "torch_npu is not installed",
        ("25.3.rc1", "8.3.RC1", "2.5.1.post1"): "predates Ascend Extension for PyTorch 7.2.0",
        ("25.3.rc1", "8.3.RC1", "2.6.0"): "predates",
    }
    for args, why in cases.items():
        cap = caps.npu_ipc_support(*args)
        assert not cap.ok and why in cap.reason, (args, cap.reason)
    for ok in ("2.1.0.post17", "2.6.0.post3", "2.8.0", "2.9.0", "2.10.0"):
        assert caps.torch_npu_meets_extension(ok).ok, ok
    noted = caps.npu_ipc_support(*good, nz="1")
    assert noted.ok and "FRACTAL_NZ" in noted.notes[0]
    assert not caps.npu_ipc_support(*good, nz="0").notes


def test_versions_are_read_from_the_ascend_install_files(tmp_path):
    root = tmp_path / "Ascend"
    (root / "driver").mkdir(parents=True)
    (root / "driver" / "version.info").write_text("Version=25.3.rc1\nascendhal_version=7.35.23\n")
    info = root / "ascend-toolkit" / "latest" / "aarch64-linux"
    info.mkdir(parents=True)
    (info / "ascend_toolkit_install.info").write_text("package_name=Ascend-cann-toolkit\nversion=8.3.RC1\n")
    etc = tmp_path / "ascend_install.info"
    assert caps.driver_version(str(root), str(etc))[0] == "25.3.rc1"
    assert caps.cann_version({}, str(root), arch="aarch64") == ("8.3.RC1", str(info / "ascend_toolkit_install.info"))
    # the installer may record another driver path; set_env.sh exports the toolkit home
    other = tmp_path / "opt"
    (other / "driver").mkdir(parents=True)
    (other / "driver" / "version.info").write_text("Version=25.5.0\n")
    etc.write_text(f"Driver_Install_Path_Param={other}\n")
    assert caps.driver_version(str(root), str(etc))[0] == "25.5.0"
    home = tmp_path / "cann-8.5.0"
    (home / "aarch64-linux").mkdir(parents=True)
    (home / "aarch64-linux" / "ascend_toolkit_install.info").write_text("version=8.5.0\n")
    assert caps.cann_version({"ASCEND_TOOLKIT_HOME": str(home)}, str(root), arch="aarch64")[0] == "8.5.0"
    assert caps.cann_version({}, str(tmp_path / "none"), arch="aarch64") == (None, "")


def test_operator_switch_disables_ipc_with_its_reason(tmp_path):
    assert caps.ipc_support("cpu", str(tmp_path), environ={}).ok
    cap = caps.ipc_support("cpu", str(tmp_path), environ={caps.DISABLE_IPC_VAR: "kernel 5.4 bug"})
    assert not cap.ok and "kernel 5.4 bug" in cap.reason
    assert not caps.ipc_support("cpu", str(tmp_path / "missing"), environ={}).ok


def test_physical_ids_map_back_to_local_indices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    assert physical_index(torch.device("cuda", 1)) == 6
    assert local_index("cuda", 6) == 1
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "4,6")
    assert local_index("npu", 6) == 1
    assert local_index("npu", 5) is None
    monkeypatch.delenv("ASCEND_RT_VISIBLE_DEVICES")
    assert local_index("npu", 5) == 5


def test_the_ray_resource_of_a_device_kind_comes_from_its_accelerator():
    # the bench asks Ray for one free device per rank of a device collective by this name
    from weightsync.device import ray_resource

    assert [ray_resource(kind) for kind in ("cuda", "npu", "cpu", "sim")] == ["GPU", "NPU", None, None]
