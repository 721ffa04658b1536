"""Internal. What a run shows about its fastest configuration, and ``--expect KEY>=VALUE`` checks on it.

The benchmark states comparisons (x the copy ceiling, x each baseline, barrier x one copy,
time growth with more receivers); it holds no targets of its own. A user who has one passes
``--expect``; a miss makes ``weightsync bench`` exit 1. Pure functions over the result dict.

Expectation grammar: ``[TRANSPORT:]KEY[@N](>=|<=)VALUE``, e.g. ``x_ceiling>=0.25``,
``shm:x_ray-numpy>=1.0``, ``growth_x@4<=2.5``. It is judged on the fastest transport row
(highest GB/s) among those that match: ``TRANSPORT`` is a row name (``shm``, ``auto->shm``)
or a ``--transport`` value; ``N`` is a receiver count (default: the smallest count run, and
for ``growth_x`` the largest). Without ``TRANSPORT`` rows with checksums off and delta rows
are left out (they are not the default configuration) unless no other row ran.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

BASELINES = ("ray-user", "ray-numpy", "bcast-per-tensor", "bcast-flat", "bcast-flat-load")
# Ray Direct Transport rows (rdt_rows): columns of the table and ratios in the JSON's comparisons
RDT_BASELINES = ("ray-rdt-gloo", "ray-rdt-cuda-ipc", "ray-rdt-nccl")
ALL_BASELINES = BASELINES[:2] + RDT_BASELINES + BASELINES[2:]

# key -> what it is (shown by --help and in the docs)
KEYS = {
    "gbps": "payload / median version time, GB/s",
    "median_s": "median version time, s",
    "x_ceiling": "GB/s over the copy ceiling's GB/s",
    "barrier_x_copy": "pre-staged barrier over one ceiling copy of the payload",
    "prefetched_x_copy": "the same barrier after the receivers ran prefetch()",
    "growth_x": "version time with N receivers over the time with the fewest, same configuration",
    **{f"x_{b}": f"{b} median over this row's median (how many times faster)" for b in ALL_BASELINES},
}

_GRAMMAR = re.compile(r"^(?:(?P<transport>[^:<>=@]+):)?(?P<key>[a-z_\-]+)(?:@(?P<n>\d+))?\s*"
                      r"(?P<op>>=|<=)\s*(?P<value>[-+0-9.eE]+)$")


@dataclass(frozen=True)
class Expectation:
    text: str
    key: str
    op: str
    value: float
    transport: str | None = None
    receivers: int | None = None


def parse_expectation(text: str) -> Expectation:
    """``--expect`` argument -> Expectation; ValueError naming what is wrong."""
    m = _GRAMMAR.match(text.strip())
    if m is None:
        raise ValueError(f"{text!r}: expected [TRANSPORT:]KEY[@N]>=VALUE or <=VALUE, e.g. x_ceiling>=0.25")
    if m["key"] not in KEYS:
        raise ValueError(f"{text!r}: unknown key {m['key']!r}; one of {', '.join(KEYS)}")
    try:
        value = float(m["value"])
    except ValueError:
        raise ValueError(f"{text!r}: {m['value']!r} is not a number") from None
    return Expectation(text=text.strip(), key=m["key"], op=m["op"], value=value, transport=m["transport"],
                       receivers=int(m["n"]) if m["n"] else None)


def _ok(row: dict[str, Any]) -> bool:
    # an A/B run's other side is compared in its own table, never taken as this run's fastest
    return (row["kind"] == "transport" and not row.get("error") and bool(row.get("median_s"))
            and row.get("side", "this") == "this")


def _same_config(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(a.get(k) == b.get(k) for k in ("name", "bucket_mb", "backend", "checksum"))


def label(row: dict[str, Any]) -> str:
    n = row["receivers"]
    return f"{row['name']} @ {row['bucket_mb']:g} MiB, {n} receiver{'s' if n != 1 else ''}"


def fastest(result: dict[str, Any], receivers: int, transport: str | None = None) -> dict[str, Any] | None:
    """The fastest transport row with ``receivers`` receivers (of ``transport`` if given) and
    every figure an expectation can name, or None when no such row ran."""
    rows = [r for r in result["rows"] if _ok(r)]
    if transport is not None:
        pool = [r for r in rows if transport in (r["name"], r.get("transport"))]
    else:
        pool = [r for r in rows if r.get("checksum") is not False and (r.get("delta") or "off") == "off"] or rows
    pool = [r for r in pool if r["receivers"] == receivers]
    if not pool:
        return None
    best = max(pool, key=lambda r: r["gbps"])
    copy_s = result["payload_bytes"] / (result["ceiling"]["gbps"] * 1e9)
    out: dict[str, Any] = {
        "row": label(best), "name": best["name"], "bucket_mb": best["bucket_mb"], "receivers": receivers,
        "gbps": best["gbps"], "median_s": best["median_s"], "x_ceiling": best.get("ceiling_ratio"),
        "barrier_x_copy": best.get("barrier_copy_ratio"),
        "prefetched_x_copy": best["prefetched_barrier_s"] / copy_s if best.get("prefetched_barrier_s") else None,
        "growth_x": None,
    }
    for base, ratio in (best.get("speedup_vs") or {}).items():
        out[f"x_{base}"] = ratio
    fewest = min(r["receivers"] for r in rows)
    if receivers > fewest:
        base_row = next((r for r in rows if r["receivers"] == fewest and _same_config(r, best)), None)
        if base_row is not None:
            out["growth_x"] = best["median_s"] / base_row["median_s"]
            out["growth_vs"] = fewest
    return out


def evaluate(result: dict[str, Any], expectations: list[Expectation]) -> list[dict[str, Any]]:
    """One record per expectation: the measured value (None: not measured in this run) and ok."""
    counts = sorted({r["receivers"] for r in result["rows"] if _ok(r)})
    out = []
    for e in expectations:
        n = e.receivers
        if n is None and counts:
            n = counts[-1] if e.key == "growth_x" else counts[0]
        rec = fastest(result, n, e.transport) if n is not None else None
        value = rec.get(e.key) if rec else None
        ok = value is not None and (value >= e.value if e.op == ">=" else value <= e.value)
        why = rec["row"] if rec else f"no {e.transport or 'transport'} row{f' with {n} receivers' if n else ''} ran"
        if rec and value is None:
            why += f": {e.key} not measured"
        out.append({"expect": e.text, "key": e.key, "op": e.op, "value": e.value, "measured": value, "ok": ok,
                    "row": why})
    return out


def _x(v: float | None, unit: str = "x") -> str:
    return "-" if v is None else f"{v:.2f}{unit}"


def comparison_lines(result: dict[str, Any]) -> list[str]:
    """Per receiver count, the fastest configuration and how it compares."""
    lines = []
    for n in sorted({r["receivers"] for r in result["rows"] if _ok(r)}):
        f = fastest(result, n)
        if f is None:
            continue
        vs = [f"{_x(f.get(f'x_{b}'))} {b}" for b in ALL_BASELINES if f.get(f"x_{b}") is not None]
        lines.append(f"fastest with {n} receiver{'s' if n != 1 else ''}: {f['row']}: {f['gbps']:.2f} GB/s = "
                     f"{_x(f['x_ceiling'])} the copy ceiling" + (f", {', '.join(vs)}" if vs else ""))
        more = []
        if f["barrier_x_copy"] is not None:
            more.append(f"pre-staged barrier {_x(f['barrier_x_copy'])} one copy"
                        + (f" ({_x(f['prefetched_x_copy'])} after prefetch())" if f["prefetched_x_copy"] else ""))
        if f["growth_x"] is not None:
            more.append(f"{_x(f['growth_x'])} the time with {f['growth_vs']} receiver{'s' if f['growth_vs'] != 1 else ''}")
        if more:
            lines.append("  " + "; ".join(more))
    return lines


def expectation_lines(checked: list[dict[str, Any]]) -> list[str]:
    return [f"{'ok  ' if c['ok'] else 'MISS'} expect {c['expect']}: measured {_x(c['measured'], '')} ({c['row']})"
            for c in checked]
