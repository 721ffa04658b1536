"""Internal. What a ``weightsync bench`` run measures, as plan items: every row of a size in run order,
the --against side's share of them, and the record of a row that did not run. Pure functions
over the parsed arguments (no Ray, no timing)."""

from __future__ import annotations

import argparse
from typing import Any

from weightsync.config import SyncConfig

from .delta_rows import delta_suffix
from .fixed_cost import FIXED_COST

# (kind, name, receivers, bucket MiB, checksum, delta)
Item = tuple[str, str, int, "float | None", bool, str]


def rows(args: argparse.Namespace, receivers: list[int]) -> list[Item]:
    """Every row of one size, in run order: (kind, name, receivers, bucket MiB, checksum, delta).
    Fixed-cost rows: per transport and receiver count (``--fixed-cost-receivers``, else
    ``receivers``), digests on and the default config's bucket size."""
    items: list[Item] = []
    fixed = getattr(args, "fixed_cost", "off")
    fixed_counts = fixed_receivers(args, receivers)
    for n in sorted(set(receivers) | set(fixed_counts)):
        if fixed != "only" and n in receivers:
            items += [("baseline", b, n, None, True, "off") for b in args.baselines]
            items += [("transport", t, n, mb, ck == "on", d) for t in args.transport for mb in args.bucket_mb
                      for ck in dict.fromkeys(args.checksum) for d in dict.fromkeys(args.delta)]
        if fixed != "off" and n in fixed_counts:
            items += [(FIXED_COST, t, n, SyncConfig.from_env().bucket_mb, True, "off") for t in args.transport]
    return items


def fixed_receivers(args: argparse.Namespace, receivers: list[int]) -> list[int]:
    """The fixed-cost rows' receiver counts: ``--fixed-cost-receivers``, else the run's."""
    if getattr(args, "fixed_cost", "off") == "off":
        return []
    return sorted(set(getattr(args, "fixed_cost_receivers", None) or receivers))


def skipped(item: Item, payload: int, why: str) -> dict[str, Any]:
    """The record of a row that did not run (``why``), named as the row that runs is."""
    kind, name, n, mb, ck, delta = item
    sync = kind in ("transport", FIXED_COST)
    transport = name if sync else None
    if sync:  # as the row that runs is named
        name += ("" if ck else " (no digest)") + delta_suffix(delta) + (f" {FIXED_COST}" if kind == FIXED_COST else "")
    return {"kind": "unavailable", "name": name, "transport": transport,
            "bucket_mb": mb, "receivers": n, "checksum": ck if sync else None,
            "delta": delta if sync else None,
            "payload_bytes": payload, "seconds": [], "median_s": None, "gbps": None, "error": why}


def sided(plan: list[Item], against: dict[str, str] | None) -> list[tuple[str, Item]]:
    """The plan's items as (side, item): this checkout's, and with --against the other rev's full
    transport and fixed-cost rows, each right after ours of the same item, so the two run back to
    back (rounds.round_order; baselines and delta rows run on this side only)."""
    out: list[tuple[str, Item]] = []
    for item in plan:
        out.append(("this", item))
        if against and item[0] in ("transport", FIXED_COST) and item[5] == "off":
            out.append(("against", item))
    return out
