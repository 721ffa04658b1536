"""The check at the weight-transfer generation (vLLM 0.23.0 / 0.32.0, vllm-ascend 0.23.0.post1,
torch_npu 2.10.0.post4) fails on a misspelt name and names the release, and a module scoped to
``vllm >= 0.23`` (test_npu_api.SCOPES) is held to those releases only."""

from __future__ import annotations

from our_uses import collect
from test_npu_api import SCOPES, VERSIONS, check, in_scope, needs_sources, package_of, trees

BROKEN = '''
import torch
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
from vllm_ascend.distributed.device_communicators.pyhccl import PyHcclCommunicator


def f(group, device):
    WeightTransferEngineFactory.register_engnie("weightsync", "weightsync_vllm.worker", "Engine")
    torch.npu.synchronise()
    PyHcclCommunicator(group, device).broadcst
'''


@needs_sources
def test_a_misspelt_name_fails_at_the_new_releases_and_scoping_skips_the_old_vllm(tmp_path):
    pkg = tmp_path / "weightsync_vllm"  # scoped like our engine: vLLM >= 0.23
    pkg.mkdir()
    (pkg / "calls.py").write_text(BROKEN)
    assert SCOPES["weightsync_vllm"] == ("vllm", "0.23.0")
    found: dict[str, list[str]] = {}
    skipped: dict[str, list[str]] = {}
    for use in collect([pkg], tmp_path):
        package = package_of(use.symbol)
        for version in VERSIONS[package]:
            if not in_scope(use, package, version):
                skipped.setdefault(use.what(), []).append(f"{package} {version}")
                continue
            problem, _ = check(trees()[(package, version)], use)
            if problem:
                found.setdefault(use.what(), []).append(f"{package} {version}: {problem}")
    register = "vllm.distributed.weight_transfer.factory.WeightTransferEngineFactory.register_engnie"
    assert found[register] == [f"vllm {v}: {register} does not exist" for v in ("0.23.0", "0.32.0")], found[register]
    # the same module's vLLM uses are not held to vLLM 0.10.1 / 0.11.0, which have no weight_transfer
    assert skipped[register] == ["vllm 0.10.1", "vllm 0.11.0"]
    assert [p.split(":")[0] for p in found["torch.npu.synchronise"]] == ["torch_npu 2.7.1", "torch_npu 2.10.0.post4"]
    assert found["torch.npu.synchronise"][1] == "torch_npu 2.10.0.post4: torch_npu.npu.synchronise does not exist"
    broadcast = "vllm_ascend.distributed.device_communicators.pyhccl.PyHcclCommunicator().broadcst"
    assert [p.split(":")[0] for p in found[broadcast]] == [f"vllm_ascend {v}" for v in VERSIONS["vllm_ascend"]]
    assert found[broadcast][-1].startswith("vllm_ascend 0.23.0.post1: vllm_ascend.distributed.device_communicators."
                                           "pyhccl.PyHcclCommunicator has no attribute 'broadcst'"), found[broadcast]
    # nothing else in the snippet is wrong, and torch_npu / vllm_ascend uses are not scoped
    assert set(found) == {register, "torch.npu.synchronise", broadcast}, found
    assert set(skipped) <= {register, "vllm.distributed.weight_transfer.factory.WeightTransferEngineFactory"}, skipped
