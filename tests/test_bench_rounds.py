"""The interleaved rounds of `weightsync bench` (weightsync_bench.rounds): the order rotation,
the per-row statistics over rounds, and the A/B side tagging and verdicts. Pure parts, no Ray."""

from __future__ import annotations

import random

import numpy as np
import pytest
from weightsync_bench import expect, rounds


def test_every_row_takes_every_position_once_per_cycle_of_rounds():
    plan = ["shm", "ipc", "broadcast", "ray-numpy"]
    orders = [rounds.round_order(plan, k) for k in range(len(plan))]
    assert orders[0] == plan, "the first round runs the plan as given"
    for order in orders:
        assert sorted(order) == sorted(plan)
    for item in plan:
        assert sorted(order.index(item) for order in orders) == list(range(len(plan)))
    assert rounds.round_order(plan, len(plan) + 1) == orders[1], "the cycle repeats"
    assert rounds.round_order([], 3) == []


def _twins(a, b):
    return a[0] == "this" and b[0] == "against" and a[1] == b[1]


def test_an_ab_pair_runs_back_to_back_and_takes_turns_going_first():
    plan = [("this", "ray-numpy"), ("this", "shm"), ("against", "shm"), ("this", "ipc"), ("against", "ipc")]
    orders = [rounds.round_order(plan, k, twins=_twins) for k in range(6)]
    assert orders[0] == plan
    for order in orders:
        assert sorted(order) == sorted(plan)
        for name in ("shm", "ipc"):
            assert abs(order.index(("this", name)) - order.index(("against", name))) == 1, order
    assert [o.index(("this", "shm")) < o.index(("against", "shm")) for o in orders] == [True, False] * 3


def test_over_two_rounds_each_side_of_a_pair_follows_its_twin_once():
    plan = [("this", "ray-numpy"), ("this", "shm"), ("against", "shm"), ("this", "ipc"), ("against", "ipc")]
    after_twin = {"this": 0, "against": 0}
    for k in range(2, 4):  # two rounds in which shm's pair is not the first slot
        order = rounds.round_order(plan, k, twins=_twins)
        for side, other in (("this", "against"), ("against", "this")):
            i = order.index((side, "shm"))
            after_twin[side] += i > 0 and order[i - 1] == (other, "shm")
    assert after_twin == {"this": 1, "against": 1}


def test_spread_is_median_min_and_numpys_quartiles():
    assert rounds.spread([5.0, 1.0, 4.0, 2.0, 3.0]) == {"median_s": 3.0, "min_s": 1.0, "q1_s": 2.0, "q3_s": 4.0,
                                                        "iqr_s": 2.0, "p90_s": pytest.approx(4.6)}
    rng = random.Random(7)
    for n in (1, 2, 6, 15):
        xs = [rng.uniform(0.1, 3.0) for _ in range(n)]
        s = rounds.spread(xs)
        q1, med, q3 = np.percentile(xs, [25, 50, 75])
        assert (s["q1_s"], s["median_s"], s["q3_s"]) == (pytest.approx(q1), pytest.approx(med), pytest.approx(q3))
        assert s["min_s"] == min(xs) and s["iqr_s"] == pytest.approx(q3 - q1)
    assert rounds.spread([])["median_s"] is None


def _round_row(k, seconds, name="shm", side="this", verified=True, cpu=0.5, load=1.0, position=0):
    return {"kind": "transport", "name": name, "transport": name, "receivers": 1, "bucket_mb": 64.0,
            "checksum": True, "side": side, "seconds": seconds, "verified": verified, "error": None,
            "stage_s": 0.1 * (k + 1), "sender_peak_extra_bytes": 100 * (k + 1), "round": k, "position": position,
            "median_s": float(np.median(seconds)), "cpu_s_per_version": cpu, "load_avg_1m": load,
            "others_cpu_s": 2.0, "row_wall_s": 9.0}


def test_a_row_pools_its_rounds_versions_and_keeps_each_rounds_figures():
    r0 = _round_row(0, [1.0, 2.0], cpu=0.4, load=1.0, position=2)
    r1 = _round_row(1, [3.0, 4.0, 5.0], cpu=0.6, load=3.0, position=0)
    other = _round_row(0, [9.0], name="ipc")
    merged = rounds.merge_all([r0, other, r1], payload=10**9)
    assert [m["name"] for m in merged] == ["shm", "ipc"]
    shm = merged[0]
    assert shm["seconds"] == [1.0, 2.0, 3.0, 4.0, 5.0] and shm["versions"] == 5
    assert (shm["median_s"], shm["min_s"], shm["iqr_s"]) == (3.0, 1.0, 2.0)
    assert shm["gbps"] == pytest.approx(1 / 3.0)
    assert shm["stage_s"] == pytest.approx(0.15) and shm["sender_peak_extra_bytes"] == 200
    assert shm["cpu_s_per_version"] == pytest.approx(0.5) and shm["load_avg_1m_range"] == [1.0, 3.0]
    assert [(r["round"], r["position"]) for r in shm["rounds"]] == [(0, 2), (1, 0)]
    assert shm["verified"] is True
    # one round with different bits makes the whole row DIFF, never averaged away
    bad = rounds.merge_rounds([r0, _round_row(1, [3.0], verified=False)], payload=10**9)
    assert bad["verified"] is False



def test_a_failed_round_is_recorded_and_left_out_of_the_statistics():
    killed = {**_round_row(0, [9.0], position=1), "error": "ActorDiedError: killed by the memory monitor"}
    row = rounds.merge_rounds([killed, _round_row(1, [1.0, 2.0]), _round_row(2, [3.0])], payload=10**9)
    assert row["error"] is None and row["seconds"] == [1.0, 2.0, 3.0] and row["median_s"] == 2.0
    assert row["failed_rounds"] == [{"round": 0, "error": killed["error"]}]
    assert [r["round"] for r in row["rounds"]] == [1, 2] and row["rounds"][0]["seconds"] == [1.0, 2.0]
    # a round skipped for memory is the same row when the plan placed it: one row, not two
    skipped = {"kind": "unavailable", "name": "shm", "side": "this", "seconds": [], "error": "skipped: 2 GiB",
               "plan_index": 4, "round": 0}
    ran = {**_round_row(1, [1.0, 2.0]), "plan_index": 4}
    (one,) = rounds.merge_all([skipped, ran], payload=10**9)
    assert one["seconds"] == [1.0, 2.0] and one["skipped_rounds"] == [{"round": 0, "why": "skipped: 2 GiB"}]
    # every round failed: the row failed
    assert rounds.merge_rounds([killed], payload=10**9)["error"] == killed["error"]


def test_the_two_sides_of_an_ab_run_stay_apart_and_are_judged_beyond_their_iqr():
    def merged(name, side, seconds):
        row = rounds.merge_rounds([_round_row(0, seconds, name=name, side=side)], payload=10**9)
        return rounds.tag_side(row, side, "e3c54a1" if side == "against" else None)

    rows = [merged("shm", "this", [1.0, 1.1, 1.2, 1.3]), merged("shm", "against", [1.5, 1.6, 1.7, 1.8]),
            merged("ipc", "this", [2.0, 2.2, 2.4, 2.6]), merged("ipc", "against", [2.3, 2.5, 2.7]),
            merged("broadcast", "this", [3.0, 3.1, 3.2]), merged("broadcast", "against", [2.0, 2.1, 2.2])]
    assert rows[1]["name"] == "shm @e3c54a1" and rows[1]["side"] == "against" and rows[0]["name"] == "shm"
    assert rounds.row_key(rows[0]) != rounds.row_key(rounds.tag_side(dict(rows[0]), "against", None))
    table = {t["transport"]: t for t in rounds.ab_table(rows)}
    assert table["shm"]["verdict"] == "faster" and table["shm"]["x_against"] == pytest.approx(1.65 / 1.15)
    assert table["ipc"]["verdict"] == "same", "overlapping IQRs are no regression"
    assert table["broadcast"]["verdict"] == "slower"
    assert all(t["rev"] == "e3c54a1" for t in table.values())
    # the other side is never this run's fastest configuration, even when it is faster
    res = {"payload_bytes": 10**9, "ceiling": {"gbps": 10.0}, "rows": rows}
    assert expect.fastest(res, 1)["name"] == "shm"
    assert rounds.format_ab(list(table.values()))[0].startswith("A/B: this checkout against e3c54a1")


def test_the_other_side_keeps_the_drivers_pythonpath_after_its_tree():
    """On a node whose Ray comes through PYTHONPATH (an offline GPU node), the other side's
    workers lost it and died importing ray (H200, --against, 2026-11-26)."""
    from weightsync_bench import interleave

    env = interleave.side_runtime_env("/tmp/wsbench-x", inherited="/tmp/site:/repo")
    assert env["env_vars"]["PYTHONPATH"] == "/tmp/wsbench-x:/tmp/site:/repo"
