"""Internal. Interleaved rounds: the order rows run in, the statistics of a row over its rounds, and the
A/B comparison of two checkouts' rows. Pure functions over plain rows (no Ray, no timing).

Why rounds: on a shared machine the neighbours' load drifts within minutes. Rows run one
after another would each see a different machine, so every ratio between rows would carry
that drift. Run every row a few versions per round, in an order rotated each round, and a
drift lands on every row alike; the spread over rounds (IQR) says how far a figure can be
trusted, and a ratio between two rows counts only beyond it.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from .fixed_cost import FIXED_COST, medians, pool

T = TypeVar("T")

# per-row fields that are medians over rounds (they are medians over versions within a round)
_MEDIAN_FIELDS = ("stage_s", "barrier_s", "prefetched_barrier_s", "sender_barrier_s")
# per-row fields that keep the largest value of any round (peaks)
_MAX_FIELDS = ("sender_peak_extra_bytes", "receiver_peak_extra_bytes", "shm_bytes", "node_shmem_extra_bytes")


def round_order(items: list[T], round_index: int, twins: Callable[[T, T], bool] | None = None) -> list[T]:
    """Round ``round_index``'s order: the plan rotated by one more place each round, so every
    row runs first once per cycle of rounds. A rotation keeps each row's predecessor, so two
    rows that are compared (an A/B pair: ``twins(a, b)`` for ``a`` right before ``b`` in the
    plan) run back to back as one slot, and which of them goes first alternates by round: each
    then follows its twin in one round and the slot before in the next, and neither always
    runs after the same neighbour's after-effects (page cache, memory freed, a burst). Before,
    with the other side's rows after all of ours, each row followed the same row every round
    (docs/benchmarks.md: the A/B's side bias)."""
    slots: list[list[T]] = []
    for item in items:
        if twins is not None and slots and len(slots[-1]) == 1 and twins(slots[-1][0], item):
            slots[-1].append(item)
        else:
            slots.append([item])
    if not slots:
        return []
    k = round_index % len(slots)
    flip = round_index % 2 == 1
    return [item for slot in slots[k:] + slots[:k] for item in (slot[::-1] if flip else slot)]


def schedule(names: list[str], warmup: int, rounds: int, versions: int) -> Iterator[tuple[int, str, int]]:
    """(round index, row, how many versions): ``warmup`` versions of each row first (round -1,
    untimed), then ``rounds`` rounds of ``versions`` each, in ``round_order``."""
    for round_index, count in [(-1, warmup)] + [(i, versions) for i in range(rounds)]:
        for name in round_order(list(names), max(0, round_index)):
            yield round_index, name, count


def quantile(values: list[float], q: float) -> float:
    """Linear-interpolated quantile (numpy's default), written out so the pure part needs no numpy."""
    xs = sorted(values)
    if not xs:
        raise ValueError("quantile of no values")
    pos = (len(xs) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def spread(seconds: list[float]) -> dict[str, float | None]:
    """median / min / quartiles / IQR / p90 of a row's version times."""
    if not seconds:
        return {k: None for k in ("median_s", "min_s", "q1_s", "q3_s", "iqr_s", "p90_s")}
    q1, q3 = quantile(seconds, 0.25), quantile(seconds, 0.75)
    return {"median_s": statistics.median(seconds), "min_s": min(seconds), "q1_s": q1, "q3_s": q3,
            "iqr_s": q3 - q1, "p90_s": quantile(seconds, 0.9)}


def row_key(row: dict[str, Any]) -> tuple:
    """What makes two rounds' rows the same row: its place in the plan where the run set one
    (a row skipped in one round for memory and run in the next is one row), else its side,
    name and configuration."""
    if row.get("plan_index") is not None:
        return ("plan", row["plan_index"])
    return (row.get("side", "this"), row.get("name"), row.get("transport"), row.get("receivers"),
            row.get("bucket_mb"), row.get("checksum"), row.get("delta"))


def merge_rounds(per_round: list[dict[str, Any]], payload: int) -> dict[str, Any]:
    """One row from its rounds: every timed version pooled for the statistics, each round's
    own figures (position in the order, load, CPU seconds) kept under ``rounds``."""
    if not per_round:
        raise ValueError("no rounds to merge")
    tried = [r for r in per_round if r["kind"] != "unavailable"]
    if not tried:
        return dict(per_round[0])
    # a round that failed (e.g. Ray's memory monitor killed an actor on a full machine) is
    # recorded, not pooled: its partial versions ran on a dying session
    ran = [r for r in tried if not r.get("error")] or tried
    row = dict(ran[0])
    row["skipped_rounds"] = [{"round": r.get("round"), "why": r.get("error")} for r in per_round
                             if r["kind"] == "unavailable"]
    row["failed_rounds"] = [{"round": r.get("round"), "error": r["error"]} for r in tried if r.get("error")]
    seconds = [s for r in ran for s in r.get("seconds") or []]
    row["seconds"] = seconds
    row["versions"] = len(seconds)
    row.update(spread(seconds))
    fixed = row["kind"] == FIXED_COST  # its bytes are next to none: GB/s says nothing
    row["gbps"] = payload / row["median_s"] / 1e9 if seconds and row["median_s"] > 0 and not fixed else None
    row["error"] = next((r["error"] for r in ran if r.get("error")), None)
    verified = [r.get("verified") for r in ran]
    row["verified"] = None if all(v is None for v in verified) else all(v is True for v in verified)
    for k in _MEDIAN_FIELDS:
        vals = [r[k] for r in ran if isinstance(r.get(k), (int, float))]
        row[k] = statistics.median(vals) if vals else None
    for k in _MAX_FIELDS:
        vals = [r[k] for r in ran if isinstance(r.get(k), (int, float))]
        row[k] = max(vals) if vals else None
    for k in ("prestaged_s", "prefetched_s", "changed_fraction"):
        row[k] = [s for r in ran for s in r.get(k) or []]
    # phases, calls per version, the sender's sync(): medians over every round's versions (the
    # samples stay out of the JSON)
    pooled = pool([r.get("samples") for r in ran])
    if pooled is not None:
        row.update(medians(pooled))
    row.pop("samples", None)
    if fixed:  # its figure is the pre-staged barrier: the same median as its seconds'
        row["barrier_s"] = row["median_s"]
    row["rounds"] = [{k: r.get(k) for k in ("round", "position", "seconds", "median_s", "load_avg_1m",
                                            "cpu_s_per_version", "others_cpu_s", "row_wall_s")} for r in ran]
    cpu = [r["cpu_s_per_version"] for r in ran if r.get("cpu_s_per_version") is not None]
    row["cpu_s_per_version"] = statistics.median(cpu) if cpu else None
    row["cpu_s_per_version_iqr"] = quantile(cpu, 0.75) - quantile(cpu, 0.25) if cpu else None
    loads = [r["load_avg_1m"] for r in ran if r.get("load_avg_1m") is not None]
    row["load_avg_1m"] = statistics.median(loads) if loads else None
    row["load_avg_1m_range"] = [min(loads), max(loads)] if loads else None
    return row


def merge_all(rounds_rows: list[dict[str, Any]], payload: int) -> list[dict[str, Any]]:
    """Every round's rows -> one merged row per row key, in the plan's (first round's) order."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in rounds_rows:
        groups.setdefault(row_key(r), []).append(r)
    return [merge_rounds(g, payload) for g in groups.values()]


def tag_side(row: dict[str, Any], side: str, rev: str | None) -> dict[str, Any]:
    """Mark a row as measured on this checkout (``this``) or on the ``--against`` rev; the
    other side's row names carry the rev so tables and speed-ups never mix the two."""
    row["side"] = side
    row["rev"] = rev
    if side != "this" and rev and not row["name"].endswith(f" @{rev}"):
        row["name"] = f"{row['name']} @{rev}"
    return row


def _ok(row: dict[str, Any]) -> bool:
    return row["kind"] in ("transport", FIXED_COST) and not row.get("error") and bool(row.get("median_s"))


def ab_table(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per transport configuration run on both sides: medians, IQRs, their ratio and a verdict.
    ``slower`` means this side's whole interquartile range lies above the other side's (its
    first quartile exceeds their third): slower beyond the spread, not by a drift of the run.
    ``faster`` is the mirror; anything overlapping is ``same``."""
    def config(r: dict[str, Any]) -> tuple:
        return (r["kind"], r.get("transport"), r.get("receivers"), r.get("bucket_mb"), r.get("checksum"), r.get("digest"),
                r.get("delta") or "off")

    other = {config(r): r for r in rows if _ok(r) and r.get("side") == "against"}
    out = []
    for r in rows:
        if not _ok(r) or r.get("side", "this") != "this" or config(r) not in other:
            continue
        a = other[config(r)]
        verdict = "slower" if r["q1_s"] > a["q3_s"] else "faster" if r["q3_s"] < a["q1_s"] else "same"
        out.append({"transport": r["transport"], "name": r["name"], "receivers": r["receivers"],
                    "bucket_mb": r["bucket_mb"], "checksum": r["checksum"], "rev": a.get("rev"),
                    "this_median_s": r["median_s"], "this_iqr_s": r["iqr_s"],
                    "against_median_s": a["median_s"], "against_iqr_s": a["iqr_s"],
                    "this_cpu_s": r.get("cpu_s_per_version"), "against_cpu_s": a.get("cpu_s_per_version"),
                    "x_against": a["median_s"] / r["median_s"], "verdict": verdict})
    return out


def format_ab(table: list[dict[str, Any]]) -> list[str]:
    if not table:
        return []
    rev = table[0]["rev"]
    lines = [f"A/B: this checkout against {rev} (same run, rounds interleaved; x >1: this side faster)"]
    for t in table:
        cpu = ""
        if t["this_cpu_s"] is not None and t["against_cpu_s"] is not None:
            cpu = f"; CPU s/version {t['this_cpu_s']:.3f} vs {t['against_cpu_s']:.3f}"
        lines.append(f"  {t['name']} {t['bucket_mb']:g}MiB x{t['receivers']}: {t['this_median_s']:.3f}s "
                     f"(IQR {t['this_iqr_s']:.3f}) vs {t['against_median_s']:.3f}s (IQR {t['against_iqr_s']:.3f}) "
                     f"= {t['x_against']:.2f}x, {t['verdict']}{cpu}")
    return lines
