"""``weightsync doctor`` run as a user runs it: the installed console script, a fresh process."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from weightsync.transports.ipc.support import DISABLE_IPC_VAR


def _doctor(*args):
    exe = shutil.which("weightsync") or os.path.join(os.path.dirname(sys.executable), "weightsync")
    env = {k: v for k, v in os.environ.items() if k != DISABLE_IPC_VAR}
    out = subprocess.run([exe, "doctor", *args], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.fixture(scope="module")
def report():
    """One run of ``weightsync doctor --json`` (a fresh process each costs seconds) read by each test."""
    return json.loads(_doctor("--json"))


def test_doctor_json_names_each_transport_and_why(report):
    assert report["platform"] == "cpu"
    assert report["versions"]["torch"].startswith(("2.", "3."))
    assert report["versions"]["ray"]
    assert set(report["transports"]) >= {"shm", "ipc", "broadcast"}
    for name, t in report["transports"].items():
        assert isinstance(t["available"], bool) and t["reason"], name
    assert report["transports"]["shm"]["available"]
    assert report["transports"]["ipc"]["available"]
    assert "/dev/shm" in report["transports"]["ipc"]["reason"]


def _doctor_here(capsys, *args):
    # in-process: the same code path as the console script, without another torch import
    from weightsync.cli import main

    assert main(["doctor", *args]) == 0
    return capsys.readouterr().out


def test_doctor_reports_ipc_unavailable_with_the_reason(capsys, monkeypatch):
    monkeypatch.setenv(DISABLE_IPC_VAR, "no shared device memory in this sandbox")
    report = json.loads(_doctor_here(capsys, "--json"))
    ipc = report["transports"]["ipc"]
    assert ipc == {"available": False, "reason": f"{DISABLE_IPC_VAR}: no shared device memory in this sandbox"}
    assert report["env"][DISABLE_IPC_VAR]


def test_doctor_text_is_pasteable(capsys):
    text = _doctor_here(capsys)
    assert text.startswith("weightsync doctor")
    for needle in ("platform:      cpu", "torch ", "ray ", "transports:", "  ipc ", "  shm "):
        assert needle in text, needle


def test_doctor_json_names_the_group_constructions_and_the_one_used_here(report):
    group = report["broadcast_group"]
    assert set(group["constructions"]["hccl"]) == {"pyhccl", "torch_npu"}
    assert set(group["constructions"]["nccl"]) == {"torch", "pynccl"}
    # this CPU machine has neither vllm-ascend nor torch_npu: each says why not
    for name in ("pyhccl", "torch_npu"):
        c = group["constructions"]["hccl"][name]
        assert c["available"] is False and "No module named" in c["reason"], (name, c)
    assert group["used_here"] == {"backend": "gloo", "communicator": "torch",
                                  "reason": "gloo: torch ProcessGroupGloo, its only construction"}


def test_doctor_reports_an_explicit_communicator_that_cannot_work(capsys, monkeypatch):
    monkeypatch.setenv("WEIGHTSYNC_COMMUNICATOR", "pyhccl")
    used = json.loads(_doctor_here(capsys, "--json"))["broadcast_group"]["used_here"]
    assert used["communicator"] is None
    assert used["reason"] == "communicator 'pyhccl' does not build a 'gloo' group; backend 'gloo' takes torch"


def test_doctor_reports_the_segment_backing_and_why(capsys, monkeypatch):
    from weightsync.transports.shm.transport import memfd_support

    assert memfd_support()[0], "this test's machine has memfd_create and /proc"
    report = json.loads(_doctor_here(capsys, "--json"))
    assert report["segments"]["backing"] == "memfd" and "/proc/<pid>/fd" in report["segments"]["reason"]
    monkeypatch.setenv("WEIGHTSYNC_SHM_BACKING", "files")
    text = _doctor_here(capsys)
    line = next(ln for ln in text.splitlines() if ln.startswith("segments:"))
    assert line.startswith("segments:      files (shm_backing=files): as configured: named files in /dev/shm")
    assert "weightsync reap" in line


def test_doctor_says_vllm_is_absent_and_names_the_verl_entry_points_of_the_installed_verl(report):
    """The main venv: no vLLM, verl 0.9.1 from the package index (no recipe/ tree)."""
    import importlib.metadata

    assert report["vllm_weight_transfer"] == {"available": False, "vllm": None, "reason": "vLLM is not installed"}
    verl = report["verl_entry_points"]
    assert verl["checkpoint_engine"]["available"] is True
    assert verl["checkpoint_engine"]["reason"] == f"verl {importlib.metadata.version('verl')} has verl.checkpoint_engine"
    assert verl["recipe_sync_group"]["available"] is False
    assert "recipe.one_step_off_policy not importable" in verl["recipe_sync_group"]["reason"]
    assert verl["stage_ahead"]["available"] is True
    text = _doctor()
    assert "vLLM weight-transfer engines:\n  no   vLLM is not installed" in text
    assert "  checkpoint_engine  yes  checkpoint-engine backend weightsync_verl.checkpoint_engine" in text


def test_python_dash_m_weightsync_is_the_command():
    """Where the console script is not on PATH, ``python -m weightsync`` runs the same command."""
    env = {k: v for k, v in os.environ.items() if k != DISABLE_IPC_VAR}
    out = subprocess.run([sys.executable, "-m", "weightsync", "doctor", "--json"], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0 and json.loads(out.stdout)["platform"] == "cpu", out.stderr
