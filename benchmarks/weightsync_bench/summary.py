"""Internal. The run's closing lines: what the rollout waits for with each transport, and one sentence
that answers "is this faster than what I would do?". Pure functions over a size's result.

What the rollout waits for: in one-step-off the trainer stages version v while the rollout
still generates with v-1, so the stall a user feels is the pre-staged barrier (``barrier_s``:
sync + apply of an already staged version), and with ``prefetch()`` during generation the
barrier after it. Each is put against one copy of the payload at the machine's copy ceiling,
the least any sync into a separate model can cost.
"""

from __future__ import annotations

from typing import Any

from .expect import fastest
from .fixed_cost import FIXED_COST
from .results import load_copy


def _ok(row: dict[str, Any]) -> bool:
    return (row["kind"] != "unavailable" and not row.get("error") and bool(row.get("median_s"))
            and row.get("side", "this") == "this")


def _s(x: float) -> str:
    return f"{x:.3f} s" if x < 10 else f"{x:.1f} s"


def copy_seconds(size: dict[str, Any]) -> float | None:
    ceiling = size.get("ceiling")
    return size["payload_bytes"] / (ceiling["gbps"] * 1e9) if ceiling and ceiling.get("gbps") else None


def barrier_lines(size: dict[str, Any]) -> list[str]:
    """Per transport row: its pre-staged barrier (and after prefetch()) over one copy, the
    copy its receivers' load needs (results.load_copy: on a device, the device's ceiling)."""
    one = copy_seconds(size)
    rows = [r for r in size["rows"] if _ok(r) and r["kind"] == "transport" and r.get("barrier_s")]
    if one is None or not rows:
        return []
    dev = {k: v for k, v in (size.get("device_ceilings") or {}).items() if v.get("gbps")}
    copies = ", ".join(f"{k} {size['payload_bytes'] / (v['gbps'] * 1e9) * 1e3:.2f} ms" for k, v in dev.items())
    lines = ["what the rollout waits for (one-step-off: staged during generation, then the barrier), "
             + (f"against one copy of the payload as each row loads it ({copies}):" if dev else
                f"against one copy of the payload ({_s(one)} at {size['ceiling']['gbps']:.2f} GB/s):")]
    for r in rows:
        copy_s, kind = load_copy(size, r)  # never None here: the host ceiling exists (``one``)
        one_word = f"one {kind} copy" if dev else "one copy"
        ahead = (f"; {_s(r['prefetched_barrier_s'])} = {r['prefetched_barrier_s'] / copy_s:.2f}x after prefetch()"
                 if r.get("prefetched_barrier_s") else "")
        q = _quartiles(r.get("prestaged_s") or [])
        spread = f" (IQR {_s(q)})" if q is not None else ""
        lines.append(f"  {r['name']} x{r['receivers']}: {_s(r['barrier_s'])}{spread} = "
                     f"{r['barrier_s'] / copy_s:.2f}x {one_word}{ahead}{_mode(r)}")
    return lines


def _mode(row: dict[str, Any]) -> str:
    """shm holding less than one version streamed through its ring of bucket buffers: the node
    had too little memory free for whole versions (shm.transport.choose_mode), so the trainer could
    not stage ahead and there was nothing to prefetch. Said, since it is another mode than shm's."""
    if row.get("transport") in ("shm", "auto") and row.get("shm_bytes") is not None \
            and row["shm_bytes"] < row.get("payload_bytes", 0):
        return " [streamed through a ring: too little memory free for whole versions]"
    return ""


def _quartiles(values: list[float]) -> float | None:
    from .rounds import spread

    return spread(values)["iqr_s"] if len(values) >= 2 else None


def _versus(ratio: float) -> str:
    return f"{ratio:.2f}x faster than" if ratio >= 1 else f"{1 / ratio:.2f}x slower than"


def verdict(size: dict[str, Any], receivers: int) -> str | None:
    """One sentence: the fastest default transport row against every baseline that ran."""
    best = fastest(size, receivers)
    if best is None:
        return None
    row = next(r for r in size["rows"] if _ok(r) and r["kind"] == "transport" and r["receivers"] == receivers
               and r["name"] == best["name"] and r["bucket_mb"] == best["bucket_mb"])
    parts, missing = [], []
    for b in size["rows"]:
        if b["kind"] in ("transport", FIXED_COST) or b["receivers"] != receivers or b.get("side", "this") != "this":
            continue
        if b["kind"] == "baseline" and _ok(b):
            parts.append(f"{_versus(b['median_s'] / row['median_s'])} {b['name']} ({_s(b['median_s'])}, "
                         f"IQR {_s(b['iqr_s'] or 0.0)})")
        else:
            missing.append(b["name"])
    if not parts:
        return None
    load = f", load average {row['load_avg_1m']:.1f}" if row.get("load_avg_1m") is not None else ""
    rest = f"; {', '.join(dict.fromkeys(missing))} did not run (see its row)" if missing else ""
    return (f"{best['name']}, the fastest transport with {receivers} receiver{'s' if receivers != 1 else ''}, moves "
            f"a version in {_s(row['median_s'])} (median, IQR {_s(row['iqr_s'] or 0.0)}{load}): "
            f"{', '.join(parts)}{rest}.")


def closing_lines(size: dict[str, Any], name_size: bool = False) -> list[str]:
    lines = barrier_lines(size)
    counts = sorted({r["receivers"] for r in size["rows"] if _ok(r) and r["kind"] == "transport"})
    sentences = [v for v in (verdict(size, n) for n in counts) if v]
    if not lines and not sentences:
        return []
    head = [f"{size['layout']['name']}:"] if name_size else []
    return ["", *head, *lines, *sentences]
