"""Internal. Delta rows of ``weightsync bench --delta``: their names, and each one beside the full row of
the same transport, bucket size, receivers and checksum, with the ratio of their medians.
Pure functions over plain rows (no Ray, no timing)."""

from __future__ import annotations

from typing import Any

DELTA_MODES = ("off", "on", "auto")


def delta_suffix(delta: str) -> str:
    """How a row's name says its delta mode: nothing for full syncs (as before delta existed)."""
    return "" if delta in ("off", None) else f" (delta {delta})"


def _ok(row: dict[str, Any]) -> bool:
    return row["kind"] == "transport" and not row.get("error") and bool(row.get("median_s"))


def _config(row: dict[str, Any]) -> tuple:
    return (row.get("side", "this"), row.get("transport"), row.get("receivers"), row.get("bucket_mb"),
            row.get("checksum"), row.get("digest"))


def mean_changed(row: dict[str, Any]) -> float | None:
    """The mean fraction of elements changed per timed version the row sent."""
    got = [f for f in row.get("changed_fraction") or [] if isinstance(f, (int, float))]
    return sum(got) / len(got) if got else None


def table(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per delta row that has a full row to stand beside. ``x_full`` > 1: the delta
    row is faster. ``beyond_spread``: the two interquartile ranges do not overlap, so the
    difference is more than the run's drift."""
    full = {_config(r): r for r in rows if _ok(r) and (r.get("delta") or "off") == "off"}
    out = []
    for r in rows:
        if not _ok(r) or (r.get("delta") or "off") == "off" or _config(r) not in full:
            continue
        f = full[_config(r)]
        apart = r.get("q3_s") is not None and f.get("q1_s") is not None and (
            r["q3_s"] < f["q1_s"] or r["q1_s"] > f["q3_s"])
        out.append({"name": r["name"], "full_name": f["name"], "transport": r["transport"], "delta": r["delta"],
                    "receivers": r["receivers"], "bucket_mb": r["bucket_mb"], "checksum": r["checksum"],
                    "delta_median_s": r["median_s"], "delta_iqr_s": r.get("iqr_s"),
                    "full_median_s": f["median_s"], "full_iqr_s": f.get("iqr_s"),
                    "x_full": f["median_s"] / r["median_s"], "beyond_spread": apart,
                    "changed_fraction": mean_changed(r)})
    return out


def format_lines(entries: list[dict[str, Any]], update: dict[str, Any] | None) -> list[str]:
    if not entries and not update:
        return []
    lines = []
    if update:
        fr = update.get("fractions") or []
        bytes_part = f", {fr[-1]['bytes']:.2%} of bytes" if fr and "bytes" in fr[-1] else ""
        lines.append(f"update: {update['model']}, {update['changed_fraction']:.2%} of elements change per "
                     f"version{bytes_part}")
    if entries:
        lines.append("delta beside full (same run, rounds interleaved; x >1: delta faster)")
    for e in entries:
        lines.append(f"  {e['name']} {e['bucket_mb']:g}MiB x{e['receivers']}: {e['delta_median_s']:.3f}s "
                     f"(IQR {e['delta_iqr_s'] or 0:.3f}) vs {e['full_name']} {e['full_median_s']:.3f}s "
                     f"(IQR {e['full_iqr_s'] or 0:.3f}) = {e['x_full']:.2f}x"
                     f"{'' if e['beyond_spread'] else ', within the spread'}")
    return lines
