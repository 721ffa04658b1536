"""Internal. What a version costs beyond its bytes: the bench's fixed-cost rows, and the coordinator
calls per version that every weightsync row records. Pure functions over plain rows (no Ray,
no timing).

A fixed-cost row moves the run's layout with every tensor cut to at most 1024 elements
(``weightsync_bench.layouts.fixed_cost``: for the default model ``qwen2.5-0.5b-fixed``, 291
tensors, 0.47 MiB), so its pre-staged barrier is the per-version host work (per tensor, in
Python) and the coordinator round trips, which decide the speed on a GPU and for small models.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

FIXED_COST = "fixed-cost"  # the rows' kind, and what their names end in
# pre-staged barriers a fixed-cost row times over all rounds, at the least: a median of fewer
# millisecond figures moves with every scheduler hiccup of a shared machine
MIN_VERSIONS = 30
# the part of the one device the fixed-cost rows' parties ask Ray for together, per side: their
# models are tiny; the rest stays the other rows' (runner.Bench's device_share)
DEVICE_SHARE = 0.05
PHASES = ("wait_s", "verify_s", "load_s", "post_load_s", "total_s")
# sender_stage / sender_sync: SyncResult.stage_calls / sync_calls; receiver: one receiver's
# apply() (last_metrics.calls, its report included); barrier: every party's calls in a
# pre-staged barrier (the sender's sync() and every receiver's apply())
CALLS = ("sender_stage", "sender_sync", "receiver", "barrier")


def versions_per_round(rounds: int, asked: int | None = None) -> int:
    """Pre-staged barriers a fixed-cost row times per round: ``asked``, else enough that the
    rounds together time ``MIN_VERSIONS``."""
    if asked is not None:
        return asked
    return math.ceil(MIN_VERSIONS / max(1, rounds))


def layout_label(label: str) -> str:
    """The name of a size's fixed-cost layout: ``qwen2.5-0.5b`` -> ``qwen2.5-0.5b-fixed``, the
    built-in layout of that name."""
    return label if label.endswith("-fixed") else f"{label}-fixed"


def new_samples() -> dict[str, dict[str, list]]:
    """Per-version figures of one row and round, pooled over rounds by ``pool``."""
    return {"phases_s": {k: [] for k in PHASES}, "calls": {k: [] for k in CALLS}, "sender": {"barrier_s": []}}


def add_version(samples: dict[str, dict[str, list]], sender: dict[str, Any], receivers: list[dict[str, Any]], *,
                phases: bool, barrier: bool) -> None:
    """One version: ``sender`` the trainer's step() / sync() reply, ``receivers`` each receiver's
    ``last_metrics``. Fields an older revision's actors lack (``--against``) count as None.
    ``phases``: the receivers' phases count for this version; ``barrier``: it was a pre-staged
    barrier (every receiver's calls fell inside it; the sender's sync() time is its barrier)."""
    calls = samples["calls"]
    got = [m.get("calls") for m in receivers]
    calls["sender_stage"].append(sender.get("stage_calls"))
    calls["sender_sync"].append(sender.get("sync_calls"))
    calls["receiver"].extend(got)
    if barrier:
        parts = [sender.get("sync_calls"), *got]
        calls["barrier"].append(None if any(p is None for p in parts) else sum(parts))
        samples["sender"]["barrier_s"].append(sender.get("barrier_s"))
    if phases:
        for k in PHASES:
            samples["phases_s"][k].extend(m.get(k) for m in receivers)


def pool(per_round: list[dict[str, dict[str, list]] | None]) -> dict[str, dict[str, list]] | None:
    """Every round's samples in one (None when no round had any)."""
    given = [s for s in per_round if s]
    if not given:
        return None
    out = new_samples()
    for s in given:
        for group, keys in out.items():
            for k, values in keys.items():
                values.extend(s.get(group, {}).get(k) or [])
    return out


def _median(values: list[Any]) -> float | None:
    nums = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return statistics.median(nums) if nums else None


def medians(samples: dict[str, dict[str, list]]) -> dict[str, Any]:
    """A row's ``phases_s``, ``calls_per_version`` and ``sender_barrier_s``: the median of each
    figure over its versions (and receivers)."""
    return {"phases_s": {k: _median(samples["phases_s"].get(k) or []) for k in PHASES},
            "calls_per_version": {k: _median(samples["calls"].get(k) or []) for k in CALLS},
            "sender_barrier_s": _median(samples.get("sender", {}).get("barrier_s") or [])}


# -- terminal ----------------------------------------------------------------------------

def _n(x: float | None) -> str:
    return "-" if x is None else f"{x:g}"


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.2f} ms"


def calls_text(calls: dict[str, Any] | None) -> str:
    """``calls/version: stage 3, sync 2, receiver 2, barrier 4``; empty where none was counted."""
    if not calls or all(calls.get(k) is None for k in CALLS):
        return ""
    return (f"calls/version: stage {_n(calls.get('sender_stage'))}, sync {_n(calls.get('sender_sync'))}, "
            f"receiver {_n(calls.get('receiver'))}, barrier {_n(calls.get('barrier'))}")


def _ok(row: dict[str, Any]) -> bool:
    return row["kind"] == FIXED_COST and not row.get("error") and bool(row.get("median_s"))


def format_lines(result: dict[str, Any]) -> list[str]:
    """Per fixed-cost row: its pre-staged barrier (the driver's and the sender's), where a
    receiver's time goes, and the coordinator calls of a version."""
    rows = [r for r in result["rows"] if _ok(r)]
    if not rows:
        return []
    lay = result.get("fixed_cost_layout") or {}
    what = (f"{lay['name']}: {lay['tensors']} tensors, {lay['payload_bytes'] / 2**20:.2f} MiB; "
            if lay.get("name") else "")
    lines = [f"fixed cost of a version ({what}pre-staged barrier, medians over every round's versions):"]
    for r in rows:
        p = r.get("phases_s") or {}
        calls = calls_text(r.get("calls_per_version"))
        lines.append(f"  {r['name']} x{r['receivers']}: barrier {_s(r['median_s'])} (IQR {_s(r.get('iqr_s'))}, "
                     f"{r['versions']} versions), sender sync {_s(r.get('sender_barrier_s'))}; receiver wait "
                     f"{_s(p.get('wait_s'))} verify {_s(p.get('verify_s'))} load {_s(p.get('load_s'))} post-load "
                     f"{_s(p.get('post_load_s'))} of {_s(p.get('total_s'))}" + (f"; {calls}" if calls else ""))
    return lines
