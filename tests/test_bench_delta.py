"""`weightsync bench --update / --delta`: the update model (weightsync_bench.updates) on the tiny
layout, delta rows beside full rows, and Ctrl-C stopping a running bench. Timing goals are not
asserted here (the machine is shared). A bench run with delta rows end to end shares its run
with the broadcast baselines: test_bench.py::test_bench_tiny_broadcast_collective_baselines_and_delta_rows."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch
from support.parties import wait_until
from weightsync_bench import delta_rows, expect, memory_fit, updates
from weightsync_bench.cli import default_store_gb
from weightsync_bench.layouts import layout, materialize

pytestmark = pytest.mark.bench  # the bench tier runs them (scripts/tiers/bench.sh)


def _changed(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[int, int]:
    """Elements and bytes that differ, counted directly on the bits."""
    elements = sum(int((a[n].view(-1).view(torch.int16) != b[n].view(-1).view(torch.int16)).sum()) for n in a)
    nbytes = sum(int((a[n].view(-1).view(torch.uint8) != b[n].view(-1).view(torch.uint8)).sum()) for n in a)
    return elements, nbytes


def _snapshot(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in tensors.items()}


def test_an_adamw_version_changes_the_fraction_the_model_counted_and_repeats_with_its_seed():
    manifest = layout("tiny")
    tensors = materialize(manifest)
    versions = updates.Versions(tensors, "adamw-1e-5", manifest)
    even = _snapshot(tensors)
    fraction = versions.apply(1)
    odd = _snapshot(tensors)
    elements, nbytes = _changed(even, odd)
    total = sum(t.numel() for t in tensors.values())
    last = versions.measured.per_step[-1]
    assert 0 < fraction < 1
    assert (elements, nbytes) == (last["elements"], last["bytes"])
    assert fraction == elements / total == versions.describe()["changed_fraction"]
    versions.apply(2)
    assert all(torch.equal(tensors[n].view(torch.int16), even[n].view(torch.int16)) for n in tensors)
    again = materialize(manifest)
    updates.Versions(again, "adamw-1e-5", manifest)
    assert all(torch.equal(again[n].view(torch.int16), even[n].view(torch.int16)) for n in tensors)


def test_a_larger_learning_rate_changes_more_elements():
    small, _ = updates.run(layout("tiny"), updates.parse("adamw-1e-6", warmup_steps=3, steps=1))
    large, _ = updates.run(layout("tiny"), updates.parse("adamw-1e-5", warmup_steps=3, steps=1))
    assert small.fractions()[0]["elements"] < large.fractions()[0]["elements"]


def test_a_random_update_changes_every_byte():
    manifest = layout("tiny")
    tensors = materialize(manifest)
    versions = updates.Versions(tensors, "random", manifest)
    before = _snapshot(tensors)
    assert versions.apply(7) == 1.0
    _, nbytes = _changed(before, tensors)
    assert nbytes == manifest.total_bytes


def test_a_delta_row_stands_beside_the_full_row_of_its_configuration():
    def row(name, delta, median, receivers=1):
        return {"kind": "transport", "name": name, "transport": "shm", "receivers": receivers, "bucket_mb": 16.0,
                "checksum": True, "digest": "auto", "delta": delta, "median_s": median, "q1_s": median * 0.9,
                "q3_s": median * 1.1, "iqr_s": median * 0.2, "changed_fraction": [0.02, 0.04], "error": None}

    rows = [row("shm", "off", 1.2), row("shm (delta on)", "on", 0.3), row("shm (delta on)", "on", 0.5, receivers=2)]
    (entry,) = delta_rows.table(rows)  # the x2 delta row has no full row to stand beside
    assert entry["x_full"] == pytest.approx(4.0) and entry["beyond_spread"] is True
    assert entry["changed_fraction"] == pytest.approx(0.03)
    # the default comparison describes the default configuration, not the faster delta row
    for r in rows:
        r["gbps"] = 1.0 / r["median_s"]
    size = {"rows": rows, "payload_bytes": 10**9, "ceiling": {"gbps": 10.0}}
    assert expect.fastest(size, 1)["name"] == "shm"
    assert expect.fastest(size, 1, transport="shm (delta on)")["name"] == "shm (delta on)"


def _session(sid: int) -> list[int]:
    found = []
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == sid and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p.pid)
        except (psutil.Error, ProcessLookupError, PermissionError):
            pass
    return found


def test_ctrl_c_stops_a_running_bench_and_leaves_nothing_behind(tmp_path):
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    env = dict(os.environ, WEIGHTSYNC_SHM_BACKING="files", WEIGHTSYNC_SHM_DIR=str(shm_dir))
    # its own session, as a terminal's foreground job: Ctrl-C reaches the whole group
    proc = subprocess.Popen(
        [sys.executable, "-m", "weightsync.cli", "bench", "--device", "cpu", "--model", "tiny", "--transport", "shm",
         "--baselines", "--checksum", "on", "--rounds", "1000", "--no-progress", "--no-verify"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True, env=env)
    try:
        seen = []
        for line in proc.stderr:  # past the first row: actors, segments and a session exist
            seen.append(line)
            if line.startswith("  shm"):
                break
        assert any(line.startswith("  shm") for line in seen), "".join(seen)
        os.killpg(proc.pid, signal.SIGINT)
        t0 = time.monotonic()
        try:
            proc.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            _, after = proc.communicate()  # what the bench did after Ctrl-C says where it stayed
            raise AssertionError(f"the bench outlived Ctrl-C by 240 s; its stderr after it:\n{after[-3000:]}") from None
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode != 0, f"exit status {proc.returncode} after {took:.1f}s"
    wait_until("the interrupted bench's Ray processes are gone", lambda: not _session(proc.pid), timeout=30,
               interval=0.5, strict=False)
    left = _session(proc.pid)
    assert left == [], f"Ray processes of the interrupted bench outlived it: {left}"
    assert sorted(os.listdir(shm_dir)) == []


def test_the_default_object_store_takes_at_most_half_of_the_free_shm_space(tmp_path):
    free_gb = memory_fit.shm_free(str(tmp_path)) / 1e9
    assert default_store_gb(10 * free_gb, str(tmp_path)) == pytest.approx(free_gb / 2, rel=0.01)
    assert default_store_gb(0.5, str(tmp_path / "missing")) == 1.0  # nothing known: what the baselines want


def test_the_documented_fraction_command_writes_what_it_prints(tmp_path, capsys):
    out = tmp_path / "fractions.json"
    assert updates.main(["--layout", "tiny", "--lr", "1e-5", "--warmup-steps", "2", "--steps", "1",
                         "--json", str(out)]) == 0
    (rec,) = json.loads(out.read_text())
    assert rec["layout"] == "tiny" and rec["update"]["lr"] == 1e-5
    assert f"elements {rec['fractions'][0]['elements']:.4%}" in capsys.readouterr().out
