"""The quick default of `weightsync bench`, its --full preset, the Ray Direct Transport
baseline rows and the closing summary. Tiny layout only; timing goals are not asserted here
(the figures are in the issue 36 report and docs/benchmarks.md)."""

from __future__ import annotations

import argparse
import json

import pytest
from weightsync_bench import rdt_rows, summary
from weightsync_bench.options import PRESETS, add_bench_arguments, apply_preset

from weightsync.cli import main

pytestmark = pytest.mark.bench  # the bench tier runs them (scripts/tiers/bench.sh)


def _parsed(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_bench_arguments(p)
    return apply_preset(p.parse_args(list(argv)))


def test_full_is_the_thorough_matrix_and_the_quick_default_its_answering_subset():
    full = _parsed("--full")
    assert (full.transport, full.checksum, full.rounds, full.versions, full.warmup, full.barrier_versions,
            full.ceiling_repeats) == (["shm", "ipc", "broadcast"], ["on", "off"], 3, 5, 2, 10, 5)
    assert full.baselines == ["ray-user", "ray-numpy", "ray-rdt", "bcast-per-tensor", "bcast-flat", "bcast-flat-load"]
    quick = _parsed()
    assert (quick.preset, quick.checksum, quick.baselines, quick.rounds, quick.versions, quick.barrier_versions) == (
        "quick", ["on"], ["ray-numpy", "ray-rdt", "bcast-flat-load"], 2, 3, 3)
    # an option given wins over its preset, the rest still comes from it
    mixed = _parsed("--full", "--rounds", "1", "--baselines")
    assert (mixed.rounds, mixed.baselines, mixed.versions) == (1, [], 5)
    assert set(PRESETS["quick"]) == set(PRESETS["full"])


def test_ray_rdt_means_the_transports_the_device_can_run_and_the_others_say_why():
    assert rdt_rows.expand(["ray-numpy", "ray-rdt"], "cpu") == ["ray-numpy", "ray-rdt-gloo"]
    assert rdt_rows.expand(["ray-rdt"], "cuda") == ["ray-rdt-cuda-ipc", "ray-rdt-nccl"]
    assert rdt_rows.unavailable("ray-rdt-gloo", "cpu") is None
    why = rdt_rows.unavailable("ray-rdt-cuda-ipc", "cpu")
    assert "ray/experimental/rdt/util.py" in why and "--device cuda" in why


def test_bench_quick_default_runs_its_rows_bit_exact_and_ends_with_the_verdict(ray_cluster, tmp_path, capsys):
    """A bare `weightsync bench` (the preset's rows; fewer versions to keep the test short):
    shm, ipc and broadcast with digests on against ray-numpy, Ray Direct Transport over GLOO and
    the flat broadcast plus load, each checked bit for bit, then the closing summary."""
    out = tmp_path / "quick.json"
    rc = main(["bench", "--device", "cpu", "--model", "tiny", "--rounds", "1", "--versions", "2", "--warmup", "1",
               "--no-progress", "--json", str(out)])
    assert rc == 0
    top = json.loads(out.read_text())
    rows = {r["name"]: r for r in top["sizes"][0]["rows"]}
    assert set(rows) == {"shm", "ipc", "broadcast", "ray-numpy", "ray-rdt-gloo", "bcast-flat-load"}
    assert {n: (r["error"], r["verified"], len(r["seconds"])) for n, r in rows.items()} == {
        n: (None, True, 2) for n in rows}
    assert rows["ray-rdt-gloo"]["transport"] == "gloo"
    assert all(len(rows[t]["prestaged_s"]) + len(rows[t]["prefetched_s"]) == 2 for t in ("shm", "ipc", "broadcast"))
    text = capsys.readouterr().out.rstrip().splitlines()
    assert "against one copy of the payload" in "\n".join(text)
    assert text[-1].startswith(("shm, the fastest", "ipc, the fastest", "broadcast, the fastest"))
    assert "ray-rdt-gloo" in text[-1] and "ray-numpy" in text[-1] and "bcast-flat-load" in text[-1]


def test_a_ray_rdt_row_that_cannot_run_here_says_why_beside_the_one_that_does(ray_cluster, tmp_path):
    out = tmp_path / "rdt.json"
    rc = main(["bench", "--device", "cpu", "--model", "tiny", "--transport", "shm", "--rounds", "1", "--versions", "2",
               "--warmup", "1", "--baselines", "ray-rdt-gloo", "ray-rdt-nccl", "--receivers", "2", "--no-progress",
               "--json", str(out)])
    assert rc == 0
    rows = {r["name"]: r for r in json.loads(out.read_text())["sizes"][0]["rows"]}
    assert rows["ray-rdt-nccl"]["kind"] == "unavailable" and "--device cuda" in rows["ray-rdt-nccl"]["error"]
    gloo = rows["ray-rdt-gloo"]
    assert (gloo["error"], gloo["verified"], gloo["receivers"]) == (None, True, 2), "both rollouts hold the trainer's bits"


def _size(rows):
    return {"layout": {"name": "x"}, "payload_bytes": 10**9, "ceiling": {"gbps": 10.0}, "rows": rows}


def _r(name, kind, median, iqr=0.01, **kw):
    return {"name": name, "kind": kind, "receivers": 1, "median_s": median, "iqr_s": iqr,
            "gbps": 1 / median if median else None,
            "bucket_mb": 16.0 if kind == "transport" else None, "checksum": True if kind == "transport" else None,
            "error": None, "load_avg_1m": 2.0, **kw}


def test_the_closing_summary_puts_each_barrier_against_one_copy_and_the_fastest_against_each_baseline():
    size = _size([_r("shm", "transport", 0.4, barrier_s=0.2, prestaged_s=[0.19, 0.2, 0.21], prefetched_barrier_s=0.15),
                  _r("broadcast", "transport", 0.5, barrier_s=0.3),
                  _r("ray-rdt-gloo", "baseline", 1.2, iqr=0.1), _r("ray-numpy", "baseline", 0.2),
                  {**_r("ray-rdt-nccl", "unavailable", None), "median_s": None, "error": "needs cuda"}])
    lines = summary.closing_lines(size)
    assert "  shm x1: 0.200 s (IQR 0.010 s) = 2.00x one copy; 0.150 s = 1.50x after prefetch()" in lines
    assert "broadcast x1: 0.300 s = 3.00x one copy" in "\n".join(lines)
    assert lines[-1] == ("shm, the fastest transport with 1 receiver, moves a version in 0.400 s (median, IQR 0.010 s, "
                         "load average 2.0): 3.00x faster than ray-rdt-gloo (1.200 s, IQR 0.100 s), 2.00x slower than "
                         "ray-numpy (0.200 s, IQR 0.010 s); ray-rdt-nccl did not run (see its row).")


def test_baselines_keep_their_actors_for_the_run_only_where_shm_keeps_room_for_whole_versions():
    from weightsync_bench import memory_fit

    gib = memory_fit.GiB
    # 1 GiB payload, 1 receiver, one flat group, 3 shm segments: models 2 + shm 6 + reserve 1.6 (of 32 GiB total)
    # + the object store's resident pages 2; the RDT pair's models 2; the group 3
    assert memory_fit.keep_baselines(gib, 1, 1, 3, available=17 * gib, total=32 * gib) == {"rdt", "groups"}
    assert memory_fit.keep_baselines(gib, 1, 1, 3, available=14 * gib, total=32 * gib) == {"rdt"}
    assert memory_fit.keep_baselines(gib, 1, 1, 3, available=12 * gib, total=32 * gib, store=False) == {"rdt"}
    assert memory_fit.keep_baselines(gib, 1, 1, 3, available=11 * gib, total=32 * gib) == set()
