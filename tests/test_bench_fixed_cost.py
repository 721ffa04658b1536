"""The bench's fixed-cost rows and its coordinator calls per version (weightsync_bench.fixed_cost):
the layout whose bytes cost nothing, the plan's rows, and the pure statistics. No Ray; the row
end to end is in tests/test_bench.py (bench tier)."""

from __future__ import annotations

import argparse

import pytest
from weightsync_bench import fixed_cost, interleave, plan, results, rounds
from weightsync_bench.layouts import FIXED_COST_ELEMS, layout
from weightsync_bench.options import add_bench_arguments, apply_preset


def _parsed(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_bench_arguments(p)
    return apply_preset(p.parse_args(list(argv)))


def test_the_fixed_cost_layout_keeps_every_tensor_and_almost_none_of_its_bytes():
    full, fixed = list(layout("qwen2.5-0.5b")), list(layout("qwen2.5-0.5b-fixed"))
    assert [(s.name, s.dtype) for s in fixed] == [(s.name, s.dtype) for s in full] and len(fixed) == 291
    assert all(s.shape == (min(f.numel, FIXED_COST_ELEMS),) for s, f in zip(fixed, full, strict=True))
    assert 0.4 * 2**20 < sum(s.nbytes for s in fixed) < 1 * 2**20


def test_fixed_cost_rows_are_planned_per_transport_and_receiver_count_and_alone_with_only():
    args = _parsed("--transport", "shm", "ipc", "--receivers", "1", "4", "--fixed-cost", "--baselines", "ray-numpy")
    items = plan.rows(args, [1, 4])
    fixed = [item for item in items if item[0] == fixed_cost.FIXED_COST]
    assert [(i[1], i[2], i[4], i[5]) for i in fixed] == [("shm", 1, True, "off"), ("ipc", 1, True, "off"),
                                                          ("shm", 4, True, "off"), ("ipc", 4, True, "off")]
    assert len(items) == len(fixed) + 2 * (1 + 2)  # beside a baseline and two transport rows per count
    only = plan.rows(_parsed("--transport", "shm", "--fixed-cost", "only"), [1])
    assert [i[:3] for i in only] == [(fixed_cost.FIXED_COST, "shm", 1)]
    assert not any(i[0] == fixed_cost.FIXED_COST for i in plan.rows(_parsed(), [1]))  # quick: off
    assert _parsed("--full").fixed_cost == "on"
    # their own receiver counts, beside the others' (a device check's: 1 receiver only)
    counts = _parsed("--transport", "shm", "--receivers", "1", "4", "--baselines", "--fixed-cost",
                     "--fixed-cost-receivers", "1", "2")
    assert [(i[0], i[2]) for i in plan.rows(counts, [1, 4])] == [
        ("transport", 1), (fixed_cost.FIXED_COST, 1), (fixed_cost.FIXED_COST, 2), ("transport", 4)]
    # with --against both sides run them, back to back
    sided = plan.sided(only, {"rev": "abc"})
    assert sided == [("this", only[0]), ("against", only[0])]
    assert interleave.planned_versions(only[0], 2, 5, 10, fixed_versions=15) == 17


def test_a_fixed_cost_row_that_cannot_run_is_named_as_the_row_that_runs():
    item = (fixed_cost.FIXED_COST, "ipc", 1, 16.0, True, "off")
    row = plan.skipped(item, 1000, "not run")
    assert (row["kind"], row["name"], row["transport"], row["payload_bytes"]) == ("unavailable", "ipc fixed-cost",
                                                                                  "ipc", 1000)


@pytest.mark.parametrize("rounds_, asked, per_round", [(1, None, 30), (2, None, 15), (3, None, 10), (4, None, 8),
                                                       (3, 4, 4)])
def test_a_fixed_cost_row_times_at_least_30_barriers_over_the_rounds_unless_asked(rounds_, asked, per_round):
    assert fixed_cost.versions_per_round(rounds_, asked) == per_round


def _round(seconds, calls, total_s, sender_barrier_s, kind=fixed_cost.FIXED_COST, round_=0):
    samples = fixed_cost.new_samples()
    for c, t, b in zip(calls, total_s, sender_barrier_s, strict=True):
        sender = {"stage_calls": 3, "sync_calls": c[0], "barrier_s": b}
        fixed_cost.add_version(samples, sender, [{"calls": c[1], "total_s": t, "wait_s": 0.0}], phases=True,
                               barrier=True)
    return {"kind": kind, "name": "shm fixed-cost", "seconds": seconds, "samples": samples, "round": round_,
            "verified": True, "barrier_s": max(seconds), "prestaged_s": seconds}


def test_phases_and_calls_are_medians_over_every_rounds_versions():
    a = _round([0.010, 0.012], [(2, 2), (2, 3)], [0.004, 0.006], [0.008, 0.009])
    b = _round([0.020], [(4, 3)], [0.010], [0.015], round_=1)
    row = rounds.merge_rounds([a, b], payload=1000)
    assert row["calls_per_version"] == {"sender_stage": 3, "sender_sync": 2, "receiver": 3, "barrier": 5}
    assert row["phases_s"]["total_s"] == 0.006 and row["phases_s"]["verify_s"] is None
    assert row["sender_barrier_s"] == 0.009
    # a fixed-cost row is its pre-staged barrier; GB/s of next to no bytes says nothing
    assert row["median_s"] == row["barrier_s"] == 0.012 and row["gbps"] is None and "samples" not in row


def test_an_older_revisions_actors_give_no_sender_calls_and_no_barrier_figure():
    samples = fixed_cost.new_samples()
    fixed_cost.add_version(samples, {"barrier_s": 0.1}, [{"calls": 2}, {}], phases=False, barrier=True)
    got = fixed_cost.medians(fixed_cost.pool([None, samples]))
    assert got["calls_per_version"] == {"sender_stage": None, "sender_sync": None, "receiver": 2, "barrier": None}
    assert got["phases_s"]["total_s"] is None
    assert fixed_cost.pool([None, None]) is None
    assert fixed_cost.calls_text(got["calls_per_version"]) == "calls/version: stage -, sync -, receiver 2, barrier -"
    assert fixed_cost.calls_text({}) == ""


def test_a_fixed_cost_row_is_compared_with_no_baseline_and_no_copy():
    fixed = {"kind": fixed_cost.FIXED_COST, "name": "shm fixed-cost", "receivers": 1, "median_s": 0.01,
             "gbps": None, "barrier_s": 0.01, "payload_bytes": 1000}
    base = {"kind": "baseline", "name": "ray-numpy", "receivers": 1, "median_s": 0.5, "gbps": 2.0,
            "payload_bytes": 10**9}
    size = {"ceiling": {"gbps": 10.0}, "payload_bytes": 10**9, "rows": [fixed, base]}
    results.add_ratios(size)
    assert (fixed["speedup_vs"], fixed["ceiling_ratio"], fixed["barrier_copy_ratio"], fixed["s_per_gb"]) == (
        {}, None, None, None)
    # nor plotted: a run of fixed-cost rows only says so instead of a PNG
    assert "no GB/s to plot" in results.write_plot({"rows": [fixed], "ceiling": None}, "unused.png")
