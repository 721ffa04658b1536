"""`weightsync bench` end to end on the tiny layout, and its pure parts (layouts from
safetensors, ratios, comparisons and --expect). Timing goals are not asserted here (see benchmarks/)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from weightsync_bench import expect, layout_source, memory_fit, results
from weightsync_bench.cli import exit_status
from weightsync_bench.runner import transport_unavailable

from weightsync.cli import main

pytestmark = pytest.mark.bench  # the bench tier runs them (scripts/tiers/bench.sh)


def test_bench_tiny_shm_end_to_end(ray_cluster, tmp_path):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    # --full: its pre-staged barriers (2 x versions per round), the rest as given here (its
    # fixed-cost rows: test_a_fixed_cost_row_times_the_prestaged_barrier_of_a_layout_without_bytes)
    rc = main(["bench", "--full", "--fixed-cost", "off", "--device", "cpu", "--model", "tiny", "--transport", "shm", "--receivers", "1", "2", "--bucket-mb", "0.25",
               "--versions", "2", "--rounds", "2", "--warmup", "1", "--baselines", "ray-user", "ray-numpy", "--ceiling-repeats", "2",
               "--checksum", "on", "off", "--no-progress", "--note", "pytest smoke", "--expect", "x_ray-user>=0", "--json", str(out), "--plot", str(png)])
    assert rc == 0
    top = json.loads(out.read_text())
    assert top["schema"] == results.SCHEMA
    assert top["note"] == "pytest smoke"
    assert top["machine"]["cpu_count"] >= 1 and top["machine"]["mem_total_bytes"] > 0
    (res,) = top["sizes"]  # one --model: one size
    assert res["layout"]["name"] == "tiny" and res["layout"]["tensors"] > 10
    payload = res["payload_bytes"]
    assert payload == sum(math.prod(s) * 2 for s in _tiny_shapes())
    ceil = res["ceiling"]
    assert ceil["gbps"] > 0 and ceil["bytes"] == payload and ceil["method"] in ceil["methods_gbps"]

    rows = {(r["name"], r["receivers"]): r for r in res["rows"]}
    assert set(rows) == {(n, k) for n in ("shm", "shm (no digest)", "ray-user", "ray-numpy") for k in (1, 2)}
    assert rows[("shm", 1)]["checksum"] is True and rows[("shm (no digest)", 1)]["checksum"] is False
    for (name, n), r in rows.items():
        assert r["error"] is None, r
        assert r["verified"] is True, f"{name} x{n}: receivers do not hold the trainer's bits"
        assert len(r["seconds"]) == 4 and all(s > 0 for s in r["seconds"]), "2 rounds x 2 versions, pooled"
        assert r["min_s"] <= r["q1_s"] <= r["median_s"] <= r["q3_s"] <= max(r["seconds"]) + 1e-12
        assert r["iqr_s"] == pytest.approx(r["q3_s"] - r["q1_s"])
        assert [g["round"] for g in r["rounds"]] == [0, 1] and r["side"] == "this"
        assert r["cpu_s_per_version"] > 0 and r["load_avg_1m"] >= 0
        assert all(g["others_cpu_s"] >= 0 and g["row_wall_s"] > 0 for g in r["rounds"])
        assert r["gbps"] == pytest.approx(payload / r["median_s"] / 1e9)
        assert r["ceiling_ratio"] == pytest.approx(r["gbps"] / ceil["gbps"])
        assert r["sender_peak_extra_bytes"] >= 0 and r["receiver_peak_extra_bytes"] >= 0
    shm = rows[("shm", 1)]
    assert shm["kind"] == "transport" and shm["bucket_mb"] == 0.25
    assert len(shm["prestaged_s"]) == 4 and shm["barrier_s"] > 0 and shm["stage_s"] > 0
    assert shm["shm_bytes"] >= payload  # at least one segment holds the whole version
    # the order rotates: the 8 rows (4 per receiver count) each shift one place in round 2
    first = {k: r["rounds"][0]["position"] for k, r in rows.items()}
    assert sorted(first.values()) == list(range(8))
    assert all(r["rounds"][1]["position"] == (first[k] - 1) % 8 for k, r in rows.items())
    assert shm["phases_s"]["total_s"] > 0
    assert shm["calls_per_version"]["receiver"] >= 1  # every weightsync row counts its coordinator calls
    assert set(shm["speedup_vs"]) == {"ray-user", "ray-numpy"}
    assert shm["speedup_vs"]["ray-user"] == pytest.approx(rows[("ray-user", 1)]["median_s"] / shm["median_s"])
    one, two = res["comparisons"]
    assert one["name"] == "shm", "rows without checksums are shown, not taken as the fastest default"
    assert two["receivers"] == 2 and two["growth_x"] == pytest.approx(
        two["median_s"] / next(r["median_s"] for r in res["rows"] if r["name"] == two["name"] and r["receivers"] == 1))
    # an expectation any working run meets: judged, recorded, and the exit status stays 0
    assert res["expectations"] == [{"expect": "x_ray-user>=0", "key": "x_ray-user", "op": ">=", "value": 0.0,
                                    "measured": pytest.approx(one["x_ray-user"]), "ok": True, "row": one["row"]}]

    pytest.importorskip("matplotlib")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_tiny_broadcast_collective_baselines_and_delta_rows(ray_cluster, tmp_path):
    """One bench run for two sets of outcomes (a bench run costs seconds of its own): the
    broadcast row and the collective baselines, and a delta row beside the full row of its
    configuration on an AdamW update (the update model: weightsync_bench.updates)."""
    out = tmp_path / "bench.json"
    rc = main(["bench", "--device", "cpu", "--model", "tiny", "--transport", "broadcast", "--backend", "gloo", "--receivers", "1",
               "--bucket-mb", "0.25", "--versions", "2", "--rounds", "1", "--warmup", "1", "--checksum", "on", "--baselines",
               "bcast-per-tensor", "bcast-flat", "bcast-flat-load", "--ceiling-repeats", "1", "--no-progress",
               "--update", "adamw-1e-6", "--delta", "off", "on", "--json", str(out)])
    assert rc == 0
    top = json.loads(out.read_text())
    (size,) = top["sizes"]
    rows = {r["name"]: r for r in size["rows"]}
    assert set(rows) == {"broadcast", "broadcast (delta on)", "bcast-per-tensor", "bcast-flat", "bcast-flat-load"}
    for name, r in rows.items():
        assert r["error"] is None, r
        # the raw flat broadcast is the wire limit only: nothing is unpacked, so nothing to check
        assert r["verified"] is (None if name == "bcast-flat" else True), f"{name}: {r['verified']}"
        assert len(r["seconds"]) == 2 and all(s > 0 for s in r["seconds"])
    assert set(rows["broadcast"]["speedup_vs"]) == {"bcast-per-tensor", "bcast-flat", "bcast-flat-load"}
    # the baselines' own actors report their CPU seconds
    assert rows["bcast-flat-load"]["cpu_s_per_version"] > 0

    # delta rows (--update / --delta): the schema, the update model's fraction, the pairing
    assert top["schema"] == results.SCHEMA == "weightsync.bench/6"
    assert top["args"]["update"] == "adamw-1e-6" and top["args"]["delta"] == ["off", "on"]
    assert size["update"]["model"] == "adamw-1e-6" and 0 < size["update"]["changed_fraction"] < 1
    for r in (rows["broadcast"], rows["broadcast (delta on)"]):
        assert r["changed_fraction"] == [size["update"]["changed_fraction"]] * 2  # one per timed version
    assert rows["broadcast"]["delta"] == "off" and rows["broadcast (delta on)"]["delta"] == "on"
    (entry,) = size["delta"]
    assert entry["full_name"] == "broadcast" and entry["x_full"] == pytest.approx(
        rows["broadcast"]["median_s"] / rows["broadcast (delta on)"]["median_s"])


def test_bench_growth_over_sizes_and_a_size_that_cannot_fit(ray_cluster, tmp_path, capsys):
    """Two sizes that run (the tiny layout, a 2 MiB safetensors layout) and one declared too large
    for any machine (a header-only file): a growth row per size and transport, the big size's
    rows skipped with why, before anything is allocated for it."""
    from safetensors.torch import save_file

    small = tmp_path / "small.safetensors"
    save_file({f"w.{i}": torch.zeros(256, 1024, dtype=torch.bfloat16) for i in range(4)}, str(small))
    huge = tmp_path / "huge.safetensors"
    header = json.dumps({"w": {"dtype": "BF16", "shape": [2**41], "data_offsets": [0, 2**42]}}).encode()
    huge.write_bytes(len(header).to_bytes(8, "little") + header)  # 4 TiB declared, no data
    out, png = tmp_path / "growth.json", tmp_path / "growth.png"
    rc = main(["bench", "--device", "cpu", "--layout", str(huge), "tiny", str(small), "--transport", "shm", "ipc",
               "--receivers", "1", "--versions", "1", "--rounds", "1", "--checksum", "on", "--warmup", "1", "--baselines", "--ceiling-repeats", "1",
               "--no-progress", "--json", str(out), "--plot", str(png)])
    assert rc == 0, "a skipped size is not a failure"
    res = json.loads(out.read_text())
    assert [s["layout"]["name"] for s in res["sizes"]] == ["tiny", "small.safetensors", "huge.safetensors"]
    payload = {s["layout"]["name"]: s["payload_bytes"] for s in res["sizes"]}
    assert payload["small.safetensors"] == 4 * 256 * 1024 * 2
    growth = {(e["layout"], e["name"]): e for e in res["growth"]}
    assert set(growth) == {(lay, t) for lay in ("tiny", "small.safetensors") for t in ("shm", "ipc")}
    assert len(res["growth"]) == 4
    for (lay, _), e in growth.items():
        assert e["size_gb"] == payload[lay] / 1e9 and e["receivers"] == 1 and e["bucket_mb"] == 16
        assert e["s_per_gb"] == pytest.approx(e["median_s"] / e["size_gb"])
        assert e["gbps"] == pytest.approx(1 / e["s_per_gb"])
        assert e["sender_peak_extra_bytes"] >= 0 and len(e["receivers_peak_extra_bytes"]) == 1
        assert e["node_shmem_extra_bytes"] >= 0 and e["shm_bytes"] >= 0
    for t in ("shm", "ipc"):
        assert growth[("tiny", t)]["x_smallest"] == 1.0
        assert growth[("small.safetensors", t)]["x_smallest"] == pytest.approx(
            growth[("small.safetensors", t)]["s_per_gb"] / growth[("tiny", t)]["s_per_gb"])
    assert growth[("small.safetensors", "shm")]["shm_bytes"] >= payload["small.safetensors"]
    big = res["sizes"][2]
    assert big["ceiling"] is None and {r["name"] for r in big["rows"]} == {"shm", "ipc"}
    assert all(r["kind"] == "unavailable" and "GiB available" in r["error"] for r in big["rows"])
    assert {(s["layout"], s["name"]) for s in res["skipped"]} == {("huge.safetensors", "shm"), ("huge.safetensors", "ipc")}
    assert all(r["verified"] is True for s in res["sizes"][:2] for r in s["rows"])
    text = capsys.readouterr().out
    assert "growth with model size" in text and "skipped huge.safetensors shm 16MiB x1: huge.safetensors needs" in text

    pytest.importorskip("matplotlib")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_memory_estimates_refuse_what_does_not_fit():
    gib = memory_fit.GiB
    need, shm = memory_fit.row_bytes("shm", 6 * gib, 16 * 2**20, 1, 3)
    assert shm == 18 * gib and need > shm  # three whole-version segments, and each party's slack
    assert memory_fit.row_bytes("broadcast", 6 * gib, 16 * 2**20, 1, 3)[1] == 0
    assert memory_fit.refusal("x", need, available=40 * gib, total=64 * gib) is None
    why = memory_fit.refusal("qwen2.5-3b shm", need, available=10 * gib, total=24 * gib, detail="3 segments")
    assert why.startswith("skipped: qwen2.5-3b shm needs about 19.0 GiB (3 segments), 10.0 GiB available")
    assert "shm directory" in memory_fit.refusal("x", gib, available=40 * gib, total=64 * gib, shm_need=gib, shm_free=gib // 2)


def _tiny_shapes():
    from weightsync_bench.layouts import layout

    return [s.shape for s in layout("tiny")]


def test_safetensors_layout_and_weights(tmp_path):
    from safetensors.torch import save_file

    a = torch.arange(12, dtype=torch.bfloat16).reshape(3, 4)
    b = torch.arange(5, dtype=torch.int64)
    save_file({"w.a": a, "w.b": b}, str(tmp_path / "model-00001.safetensors"))
    save_file({"w.c": torch.ones(2, dtype=torch.float32)}, str(tmp_path / "model-00002.safetensors"))
    label, m, path = layout_source.resolve(str(tmp_path), None)
    assert path == str(tmp_path)
    assert {s.name: (s.dtype, s.shape) for s in m} == {
        "w.a": ("bfloat16", (3, 4)), "w.b": ("int64", (5,)), "w.c": ("float32", (2,))}
    assert m[2].name == "w.c"  # files in name order
    _, cast, _ = layout_source.resolve(str(tmp_path / "model-00001.safetensors"), "float32")
    assert {s.name: s.dtype for s in cast} == {"w.a": "float32", "w.b": "int64"}  # ints are kept
    w = layout_source.load_weights(str(tmp_path), m)
    assert list(w) == [s.name for s in m] and torch.equal(w["w.a"], a) and torch.equal(w["w.b"], b)
    with pytest.raises(FileNotFoundError, match="neither a built-in layout"):
        layout_source.resolve(str(tmp_path / "nope"), None)


def test_missing_transport_or_backend_is_reported_not_run():
    assert transport_unavailable("shm", "auto", "cpu") is None
    assert transport_unavailable("broadcast", "nccl", "cpu")  # either not built or needs CUDA: a reason


def _row(name, kind, n, median, bucket=None, barrier=None):
    return {"name": name, "kind": kind, "receivers": n, "median_s": median, "gbps": 1.0 / median,
            "bucket_mb": bucket, "barrier_s": barrier, "error": None}


def _result(rows):
    res = {"payload_bytes": 10**9, "ceiling": {"gbps": 10.0}, "rows": rows}
    results.add_ratios(res)
    return res


_ROWS = [
    _row("ray-user", "baseline", 1, 4.0), _row("ray-numpy", "baseline", 1, 0.3),
    {**_row("shm", "transport", 1, 0.2, 64, barrier=0.12), "checksum": True},
    {**_row("shm (no digest)", "transport", 1, 0.1, 64, barrier=0.05), "checksum": False},
    {**_row("ipc", "transport", 1, 0.25, 64, barrier=0.2), "checksum": True},
    {**_row("shm", "transport", 4, 0.5, 64, barrier=0.3), "checksum": True},
    {**_row("ipc", "unavailable", 1, 1.0, 64), "median_s": None, "error": "not built"},
]


def test_comparisons_describe_the_fastest_default_row_without_targets():
    res = _result([dict(r) for r in _ROWS])
    one = expect.fastest(res, 1)
    assert one["row"] == "shm @ 64 MiB, 1 receiver"  # the no-xxh3 row is faster but not the default
    assert one["x_ray-user"] == pytest.approx(20.0) and one["x_ray-numpy"] == pytest.approx(1.5)
    assert one["x_ceiling"] == pytest.approx(0.5) and one["barrier_x_copy"] == pytest.approx(1.2)
    assert expect.fastest(res, 4)["growth_x"] == pytest.approx(2.5)
    res["expectations"] = []
    text = results.format_table({**res, "layout": {"name": "x", "tensors": 1, "dtype": "bf16"},
                                "machine": {"cpu_model": "c", "cpu_count": 2, "mem_total_bytes": 2**30},
                                "args": {"device": "cpu", "versions": 1, "warmup": 0},
                                "ceiling": {"gbps": 10.0, "method": "m"}})
    assert "unavailable: not built" in text
    assert "fastest with 1 receiver: shm @ 64 MiB, 1 receiver: 5.00 GB/s = 0.50x the copy ceiling" in text
    assert "target" not in text and "PASS" not in text and "MISS" not in text


@pytest.mark.parametrize("text, measured, ok", [
    ("x_ceiling>=0.4", 0.5, True),
    ("x_ray-numpy>=2", 1.5, False),
    ("shm (no digest):gbps>=9", 10.0, True),
    ("ipc:barrier_x_copy<=1.5", 2.0, False),
    ("growth_x<=2", 2.5, False),
    ("growth_x@4<=3", 2.5, True),
    ("ipc:gbps@4>=1", None, False),  # no ipc row with 4 receivers ran: a miss, not a pass
])
def test_expectations_are_judged_on_the_fastest_matching_row(text, measured, ok):
    (checked,) = expect.evaluate(_result([dict(r) for r in _ROWS]), [expect.parse_expectation(text)])
    assert (checked["measured"], checked["ok"]) == (pytest.approx(measured) if measured else None, ok)


def test_a_missed_expectation_is_a_non_zero_exit():
    res = _result([dict(r) for r in _ROWS])
    res["expectations"] = expect.evaluate(res, [expect.parse_expectation("x_ceiling>=0.4")])
    assert exit_status(res) == 0
    res["expectations"] += expect.evaluate(res, [expect.parse_expectation("x_ceiling>=0.6")])
    assert exit_status(res) == 1


@pytest.mark.parametrize("text", ["x_ceiling>0.4", "speed>=1", "x_ceiling>=fast", "x_ceiling"])
def test_a_malformed_expectation_stops_the_bench_before_it_runs(text, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["bench", "--expect", text])
    assert stop.value.code == 2 and "--expect" in capsys.readouterr().err


def test_floors_script_does_the_real_work(tmp_path):
    """benchmarks/floors.py (the data path's floor, no protocol) moves real bytes: the engine
    ends bit-exact on both paths, and every figure it reasons from was measured."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "floors.py"
    out = tmp_path / "floors.json"
    # its own session: on a timeout the whole group goes (the script's spawned workers and the
    # /dev/shm file they map would otherwise outlive the test)
    started = time.time()
    proc = subprocess.Popen([sys.executable, str(script), "--model", "tiny", "--repeats", "1", "--receivers", "1", "2",
                             "--json", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        stdout, _ = proc.communicate(timeout=240)  # before pytest-timeout's 300 s, so this cleans up
    except subprocess.TimeoutExpired:
        raise AssertionError("benchmarks/floors.py ran past 240 s") from None
    finally:
        if proc.poll() is None:  # a timeout here or pytest's: the group and its file go
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            for leftover in Path("/dev/shm").glob("wsync-floors-*"):
                if leftover.stat().st_mtime >= started:  # this run's, not a concurrent one's
                    leftover.unlink(missing_ok=True)
    assert proc.returncode == 0, stdout
    r = json.loads(out.read_text())
    assert r["verified"] is True
    assert set(r["host_s"]) == {"stage", "apply", "together", "stage (no xxh3)", "apply (no xxh3)",
                                "together (no xxh3)", "together x2"}
    assert set(r["gloo_s"]) == {"flat", "buckets", "buckets+load"}
    assert all(s > 0 for s in [*r["host_s"].values(), *r["gloo_s"].values()])
    assert "shm / copy ceiling at best" in stdout


def test_bench_ab_runs_another_revs_transports_in_the_same_rounds(ray_cluster, tmp_path):
    """--against HEAD: the rev's tree is extracted, its own actors import it, and its shm rows
    take turns with ours; every row says its side, and the A/B table pairs them."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    out = tmp_path / "ab.json"
    rc = main(["bench", "--device", "cpu", "--model", "tiny", "--transport", "shm", "--receivers", "1",
               "--bucket-mb", "0.25", "--versions", "2", "--rounds", "2", "--warmup", "1", "--checksum", "on",
               "--baselines", "ray-numpy", "--against", "HEAD", "--ceiling-repeats", "1", "--no-progress",
               "--json", str(out)])
    assert rc == 0
    top = json.loads(out.read_text())
    assert top["args"]["against"] == {"rev": head, "asked": "HEAD"}
    rows = {(r["side"], r["name"]): r for r in top["sizes"][0]["rows"]}
    assert set(rows) == {("this", "ray-numpy"), ("this", "shm"), ("against", f"shm @{head}")}
    other = rows[("against", f"shm @{head}")]
    assert other["rev"] == head and other["verified"] is True and len(other["seconds"]) == 4
    # the two shm rows back to back as one slot, the slots rotated, and which side goes first
    # alternating: (ray-numpy, ours, theirs), then (theirs, ours, ray-numpy)
    positions = {key: [rnd["position"] for rnd in r["rounds"]] for key, r in rows.items()}
    assert positions == {("this", "ray-numpy"): [0, 2], ("this", "shm"): [1, 1], ("against", f"shm @{head}"): [2, 0]}
    (ab,) = top["sizes"][0]["ab"]
    assert ab["transport"] == "shm" and ab["rev"] == head and ab["verdict"] in ("slower", "same", "faster")
    assert ab["x_against"] == pytest.approx(other["median_s"] / rows[("this", "shm")]["median_s"])
    assert set(rows[("this", "shm")]["speedup_vs"]) == {"ray-numpy"}


def test_rows_whose_turn_comes_after_the_deadline_are_recorded_not_run(ray_cluster, tmp_path, capsys):
    """--deadline-s: a run with a hard time limit still writes its JSON; here the deadline has
    passed before the first row, so every row is there, marked not run, and nothing failed."""
    out = tmp_path / "late.json"
    rc = main(["bench", "--device", "cpu", "--model", "tiny", "--transport", "shm", "ipc", "--baselines",
               "--rounds", "1", "--no-progress", "--deadline-s", "0", "--json", str(out)])
    rows = json.loads(out.read_text())["sizes"][0]["rows"]
    assert (rc, sorted((r["name"], r["error"]) for r in rows)) == (
        0, [(n, "not run: --deadline-s 0 passed before its turn") for n in ("ipc", "shm")])


def test_a_fixed_cost_row_times_the_prestaged_barrier_of_a_layout_without_bytes(ray_cluster, tmp_path, capsys):
    """--fixed-cost only: the shm row between actors that hold the tiny layout cut to <= 1024
    elements a tensor, its pre-staged barriers split into the receiver's phases, the sender's
    sync() and the coordinator calls of a version (weightsync_bench.fixed_cost)."""
    from weightsync_bench.layouts import fixed_cost, layout

    out = tmp_path / "fixed.json"
    rc = main(["bench", "--device", "cpu", "--model", "tiny", "--transport", "shm", "--receivers", "1",
               "--fixed-cost", "only", "--fixed-cost-versions", "3", "--rounds", "1", "--warmup", "1",
               "--no-progress", "--json", str(out)])
    assert rc == 0
    top = json.loads(out.read_text())
    assert (top["args"]["fixed_cost"], top["args"]["fixed_cost_versions"]) == ("only", 3)
    (size,) = top["sizes"]
    payload = sum(s.nbytes for s in fixed_cost(layout("tiny")))
    assert size["fixed_cost_layout"] == {"name": "tiny-fixed", "tensors": size["layout"]["tensors"],
                                         "payload_bytes": payload}
    assert size["ceiling"] is None  # only these rows: no copy to compare with
    (row,) = size["rows"]
    assert (row["kind"], row["name"], row["error"], row["verified"]) == ("fixed-cost", "shm fixed-cost", None, True)
    assert row["payload_bytes"] == payload and row["gbps"] is None
    assert row["versions"] == 3 and row["seconds"] == row["prestaged_s"] and row["prefetched_s"] == []
    assert row["barrier_s"] == row["median_s"] > 0
    # the sender's sync() and the receiver's apply() both lie inside the barrier the driver times
    assert 0 < row["sender_barrier_s"] <= row["barrier_s"]
    phases = row["phases_s"]
    assert set(phases) == {"wait_s", "verify_s", "load_s", "post_load_s", "total_s"}
    assert all(v >= 0 for v in phases.values()) and 0 < phases["total_s"] <= row["barrier_s"]
    calls = row["calls_per_version"]
    assert set(calls) == {"sender_stage", "sender_sync", "receiver", "barrier"}
    assert calls["sender_stage"] >= 1 and calls["sender_sync"] >= 1 and calls["receiver"] >= 1
    assert calls["barrier"] >= calls["receiver"] + 1  # the sender's sync() calls at least once
    text = capsys.readouterr().out
    assert "fixed cost of a version (tiny-fixed: " in text and "shm fixed-cost x1: barrier " in text
