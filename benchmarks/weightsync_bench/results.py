"""Internal. Turns benchmark rows into ratios, a terminal table with comparisons, JSON and a PNG plot.
Pure functions over the result dict (schema: docs/benchmarks.md, "JSON schema")."""

from __future__ import annotations

import json
import math
import os
import platform
import socket
from typing import Any

from .delta_rows import format_lines as delta_lines
from .expect import ALL_BASELINES, comparison_lines, expectation_lines
from .fixed_cost import FIXED_COST, calls_text
from .fixed_cost import format_lines as fixed_cost_lines
from .rounds import format_ab

# /2: "checks" against built-in targets gave way to "comparisons" and the user's "expectations"
# /3: several model sizes per run: each size's layout, ceiling, rows, comparisons and
# expectations moved under "sizes"; "growth" compares time per GB across them
# /4: rows pooled over interleaved rounds: q1_s / q3_s / iqr_s, cpu_s_per_version, load_avg_1m,
# "rounds" per row; "side" / "rev" per row and a size's "ab" table with --against
# /5: --update and --delta: args "update" / "delta", a size's "update" (the model, the changed
# fractions it measured) and "delta" table (delta rows beside full rows), per row "delta" and
# "changed_fraction" (the fraction of elements changed in each timed version)
# /6: fixed-cost rows (kind "fixed-cost", a size's "fixed_cost_layout", args "fixed_cost" /
# "fixed_cost_versions"), "calls_per_version" per weightsync row, "phases_s" over every round
SCHEMA = "weightsync.bench/6"


def _ok(row: dict[str, Any]) -> bool:
    return row["kind"] != "unavailable" and not row.get("error") and bool(row.get("median_s"))


# the copy a receiver's load cannot avoid on an accelerator: from a device buffer (ipc, a device
# collective) or from host memory (shm) into the model on the device
LOAD_COPY = {"ipc": "device-to-device", "broadcast": "device-to-device", "shm": "host-to-device"}


def load_copy(size: dict[str, Any], row: dict[str, Any]) -> tuple[float, str] | None:
    """(seconds, kind) of one copy of the payload as ``row``'s receivers load it: on a device
    the device ceiling of where its bytes arrive (one host copy would flatter a device barrier:
    an H200's host copy takes 57x its device-to-device copy), else the host ceiling."""
    transport = row.get("chosen") or row.get("transport")
    kind = LOAD_COPY.get(transport or "")
    dev = (size.get("device_ceilings") or {}).get(kind or "")
    if dev and dev.get("gbps"):
        return size["payload_bytes"] / (dev["gbps"] * 1e9), kind
    ceiling = size.get("ceiling")
    if ceiling and ceiling.get("gbps"):
        return size["payload_bytes"] / (ceiling["gbps"] * 1e9), ceiling.get("kind", "host-to-host")
    return None


def add_ratios(result: dict[str, Any]) -> None:
    """Fill ``ceiling_ratio``, ``barrier_copy_ratio`` and ``speedup_vs`` of every row."""
    ceiling = result["ceiling"]
    rows = result["rows"]
    for row in rows:
        if row["kind"] == FIXED_COST:  # its bytes are next to none: per GB, against a copy or a baseline, nothing
            row.update(s_per_gb=None, ceiling_ratio=None, barrier_copy_ratio=None, speedup_vs={})
            continue
        row["s_per_gb"] = row["median_s"] / (row["payload_bytes"] / 1e9) if _ok(row) and row.get("payload_bytes") else None
        row["ceiling_ratio"] = row["gbps"] / ceiling["gbps"] if _ok(row) and row.get("gbps") else None
        copy = load_copy(result, row)
        row["barrier_copy_ratio"] = row["barrier_s"] / copy[0] if _ok(row) and row.get("barrier_s") and copy else None
        row["speedup_vs"] = {}
        if not _ok(row):
            continue
        for base in rows:
            if base["kind"] == "baseline" and base is not row and _ok(base) and base["receivers"] == row["receivers"]:
                row["speedup_vs"][base["name"]] = base["median_s"] / row["median_s"]


# -- terminal ----------------------------------------------------------------------------

def _f(x: Any, fmt: str = "{:.3f}", none: str = "-") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return none
    return fmt.format(x)


def _mib(x: Any) -> str:
    return _f(x / 2**20 if x is not None else None, "{:.0f}")


def format_table(result: dict[str, Any]) -> str:
    c = result["ceiling"]
    lay = result["layout"]
    title = (f"weightsync bench: {lay['name']} ({lay['tensors']} tensors, {result['payload_bytes'] / 2**30:.2f} GiB "
             f"{lay['dtype']}), device={result['args']['device']}")
    if c is None and not any(_ok(r) for r in result["rows"]):
        # the whole size was skipped before it started: every row says why
        return "\n".join([title, *dict.fromkeys(f"  {r['error']}" for r in result["rows"])])
    args, fixed = result["args"], result["args"].get("fixed_cost_versions")
    timed = [] if args.get("fixed_cost") == "only" else [f"{args['versions']} versions"]
    timed += [f"{fixed} fixed-cost barriers"] if fixed else []
    head = [
        f"{title}, {args.get('rounds', 1)} interleaved rounds x {' + '.join(timed)} (after {args['warmup']} "
        "warm-up each)",
        f"machine: {result['machine']['cpu_model']}, {result['machine']['cpu_count']} cores, "
        f"{result['machine']['mem_total_bytes'] / 2**30:.0f} GiB" + (
            f"; copy ceiling {c['gbps']:.2f} GB/s ({c['method']}, one copy {result['payload_bytes'] / c['gbps'] / 1e9:.3f} s)"
            if c else ""),
    ]
    for k, v in (result.get("device_ceilings") or {}).items():
        head.append(f"  {k}: {v['gbps']:.1f} GB/s")
    bases = [b for b in ALL_BASELINES if any(r["name"] == b and _ok(r) for r in result["rows"])]
    cols = ["row", "rcv", "bucket", "median s", "min s", "IQR s", "GB/s", "x ceil"] + [f"x {b}" for b in bases] + [
        "cpu s/v", "load", "stage s", "barrier s", "snd+MiB", "rcv+MiB", "shm+MiB", "bits"]
    lines = []
    said = set()
    for r in result["rows"]:
        if r["kind"] == "unavailable" or (r.get("error") and not r.get("seconds")):
            if r["kind"] == "unavailable" and (r["name"], r["error"]) in said:
                continue  # one line per missing transport, not one per receiver count and bucket
            said.add((r["name"], r["error"]))
            lines.append([r["name"], str(r.get("receivers")), _f(r.get("bucket_mb"), "{:g}"),
                          f"{'unavailable' if r['kind'] == 'unavailable' else 'FAILED'}: {r['error']}"])
            continue
        speed = r.get("speedup_vs", {})
        vs = []
        for b in bases:
            vs.append(_f(speed.get(b), "{:.1f}x"))
        lines.append([r["name"], str(r.get("receivers")), _f(r.get("bucket_mb"), "{:g}"), _f(r.get("median_s")),
                      _f(r.get("min_s")), _f(r.get("iqr_s")), _f(r.get("gbps"), "{:.2f}"),
                      _f(r.get("ceiling_ratio"), "{:.2f}"), *vs,
                      _f(r.get("cpu_s_per_version")), _f(r.get("load_avg_1m"), "{:.1f}"),
                      _f(r.get("stage_s")), _f(r.get("barrier_s")), _mib(r.get("sender_peak_extra_bytes")),
                      _mib(r.get("receiver_peak_extra_bytes")), _mib(r.get("node_shmem_extra_bytes")),
                      {True: "ok", False: "DIFF", None: "-"}[r.get("verified")]])
    widths = [max([len(c)] + [len(ln[i]) for ln in lines if i < len(ln) - (len(ln) != len(cols))])
              for i, c in enumerate(cols)]
    out = head + ["", "  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=False))]
    for ln in lines:
        if len(ln) == len(cols):
            out.append("  ".join(v.ljust(w) for v, w in zip(ln, widths, strict=False)))
        else:
            out.append("  ".join(v.ljust(w) for v, w in zip(ln[:3], widths, strict=False)) + "  " + ln[3])
    summary = comparison_lines(result) + format_ab(result.get("ab") or []) + delta_lines(
        result.get("delta") or [], result.get("update") if result["args"].get("update", "random") != "random"
        else None) + expectation_lines(result.get("expectations") or [])
    if summary:
        out += [""] + summary
    for r in result["rows"]:
        if _ok(r) and r["kind"] == "transport" and r.get("phases_s", {}).get("total_s"):
            p = r["phases_s"]
            ahead = (f"; barrier {_f(r.get('barrier_s'))}s, {_f(r.get('prefetched_barrier_s'))}s after prefetch()"
                     if r.get("prefetched_barrier_s") else "")
            calls = calls_text(r.get("calls_per_version"))
            out.append(f"  {r['name']} {r['bucket_mb']:g}MiB x{r['receivers']}: receiver wait {_f(p.get('wait_s'))}s "
                       f"verify {_f(p.get('verify_s'))}s load {_f(p.get('load_s'))}s of {_f(p.get('total_s'))}s; "
                       f"trainer stage {_f(r.get('stage_s'))}s{ahead}" + (f"; {calls}" if calls else ""))
    out += fixed_cost_lines(result)
    return "\n".join(out)


# -- JSON ----------------------------------------------------------------------------------

def _clean(x: Any) -> Any:
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return None
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def write_json(result: dict[str, Any], path: str) -> None:
    with open(path, "w") as f:
        json.dump(_clean(result), f, indent=2, sort_keys=False, default=str)
        f.write("\n")


# -- plot ----------------------------------------------------------------------------------

def _gbps_range(row: dict[str, Any]) -> tuple[float, float]:
    """GB/s at the third and the first quartile of the version times (the slow and fast ends)."""
    q1, q3 = row.get("q1_s"), row.get("q3_s")
    if not q1 or not q3:
        return row["gbps"], row["gbps"]
    return row["payload_bytes"] / q3 / 1e9, row["payload_bytes"] / q1 / 1e9


def write_plot(result: dict[str, Any], path: str) -> str | None:
    """GB/s per transport and bucket size (one panel per receiver count), baselines beside
    them, the copy ceiling as a line. Returns why not when nothing ran to plot or matplotlib is missing."""
    rows = [r for r in result["rows"] if _ok(r) and r["kind"] != FIXED_COST]
    if not rows or not result.get("ceiling"):
        return "no transport or baseline row ran (a fixed-cost row has no GB/s to plot)"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'weightsync[plot]')"
    counts = sorted({r["receivers"] for r in rows}) or [1]
    fig, axes = plt.subplots(1, len(counts), figsize=(max(7, 5.5 * len(counts)), 4.8), squeeze=False, sharey=True)
    ceiling = result["ceiling"]["gbps"]
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    names = sorted({r["name"] for r in rows}, key=lambda n: (n in ALL_BASELINES, n))
    color = {n: palette[i % len(palette)] for i, n in enumerate(names)}
    for ax, n in zip(axes[0], counts, strict=False):
        mine = [r for r in rows if r["receivers"] == n]
        transports = [r for r in mine if r["kind"] == "transport"]
        baselines = [r for r in mine if r["kind"] == "baseline"]
        labels, heights, colors, err = [], [], [], [[], []]
        for r in sorted(transports, key=lambda r: (r["name"], r["bucket_mb"])) + baselines:
            labels.append(r["name"] + (f"\n{r['bucket_mb']:g} MiB" if r.get("bucket_mb") else "\n(baseline)"))
            heights.append(r["gbps"])
            colors.append(color[r["name"]])
            lo, hi = _gbps_range(r)  # the interquartile range of version times, as GB/s
            err[0].append(max(0.0, r["gbps"] - lo))
            err[1].append(max(0.0, hi - r["gbps"]))
        xs = range(len(labels))
        bars = ax.bar(xs, heights, color=colors, edgecolor="black", linewidth=0.5, yerr=err, capsize=3,
                      error_kw={"linewidth": 0.8})
        for bar, h in zip(bars, heights, strict=False):
            ax.annotate(f"{h:.2f}", (bar.get_x() + bar.get_width() / 2, h), ha="center", va="bottom", fontsize=8)
        ax.axhline(ceiling, color="red", linestyle="--", linewidth=1.2)
        ax.annotate(f"copy ceiling {ceiling:.1f} GB/s", (len(labels) - 0.5, ceiling), ha="right", va="bottom",
                    color="red", fontsize=8)
        crowded = len(labels) > 5
        ax.set_xticks(list(xs), labels, fontsize=8, rotation=35 if crowded else 0, ha="right" if crowded else "center")
        ax.set_title(f"{n} receiver{'s' if n > 1 else ''}")
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel("GB/s per version, median; bars: IQR (higher is better)")
    lay = result["layout"]
    m = result["machine"]
    fig.suptitle(f"weightsync bench: {lay['name']} {result['payload_bytes'] / 2**30:.2f} GiB {lay['dtype']}, "
                 f"{m['cpu_count']} cores ({m['cpu_model']}), device={result['args']['device']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def machine_info() -> dict[str, Any]:
    import psutil
    import ray
    import torch

    import weightsync

    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "hostname": socket.gethostname(), "cpu_model": model, "cpu_count": os.cpu_count(),
        "mem_total_bytes": psutil.virtual_memory().total, "load_avg_start": list(os.getloadavg()),
        "platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
        "ray": ray.__version__, "weightsync": weightsync.__version__,
    }
