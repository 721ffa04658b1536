"""Internal. How time and memory grow with the model: the growth table over a run's sizes (``weightsync
bench --layout A B C``), its terminal form and its plot. Pure functions over the result dict
(schema: docs/benchmarks.md)."""

from __future__ import annotations

from typing import Any

from .fixed_cost import FIXED_COST
from .results import _f, _mib, _ok

_CONFIG = ("name", "bucket_mb", "receivers", "backend", "checksum", "digest")


def _config(row: dict[str, Any]) -> tuple:
    return tuple(row.get(k) for k in _CONFIG)


def table(sizes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per row that ran, per size, smallest size first: seconds per version and per
    GB, and ``x_smallest``, s/GB over the same configuration's s/GB at the smallest size that
    ran it (1.0 there); memory per party and the node's shared memory during the row."""
    out: list[dict[str, Any]] = []
    first: dict[tuple, float] = {}
    for size in sorted(sizes, key=lambda s: s["payload_bytes"]):
        gb = size["payload_bytes"] / 1e9
        for r in size["rows"]:
            if not _ok(r) or r["kind"] == FIXED_COST:  # its bytes do not grow with the model: no s/GB
                continue
            s_per_gb = r["median_s"] / gb
            base = first.setdefault(_config(r), s_per_gb)
            out.append({
                "layout": size["layout"]["name"], "size_gb": gb, "name": r["name"], "kind": r["kind"],
                "bucket_mb": r.get("bucket_mb"), "receivers": r["receivers"], "checksum": r.get("checksum"),
                "median_s": r["median_s"], "gbps": r["gbps"], "s_per_gb": s_per_gb, "x_smallest": s_per_gb / base,
                # the fastest version is the one least disturbed by other work on a shared machine
                "min_s_per_gb": r["min_s"] / gb if r.get("min_s") else None,
                "sender_peak_extra_bytes": r.get("sender_peak_extra_bytes"),
                "receivers_peak_extra_bytes": r.get("receivers_peak_extra_bytes") or [],
                "node_shmem_extra_bytes": r.get("node_shmem_extra_bytes"), "shm_bytes": r.get("shm_bytes"),
            })
    # grouped by configuration, sizes in order within each
    order = {c: i for i, c in enumerate(dict.fromkeys(_config(e) for e in out))}
    return sorted(out, key=lambda e: (order[_config(e)], e["size_gb"]))


def skipped(sizes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows the memory check skipped: which size and row, and why."""
    return [{"layout": s["layout"]["name"], "name": r["name"], "bucket_mb": r.get("bucket_mb"),
             "receivers": r["receivers"], "why": r["error"]}
            for s in sizes for r in s["rows"] if r["kind"] == "unavailable" and str(r.get("error")).startswith("skipped:")]


def _label(e: dict[str, Any]) -> str:
    return e["name"] + (f" {e['bucket_mb']:g}MiB" if e.get("bucket_mb") else "") + f" x{e['receivers']}"


def format_table(result: dict[str, Any]) -> str:
    """The growth table: per configuration and size, s/version, s/GB and its ratio to the
    smallest size, memory per party (MiB over the model) and the node's shared memory."""
    growth = result.get("growth") or []
    lines = []
    if len({e["layout"] for e in growth}) > 1:
        cols = ["row", "layout", "size GB", "s/version", "GB/s", "s/GB", "x smallest", "min s/GB", "snd+MiB", "rcv+MiB each",
                "shm+MiB", "segs MiB"]
        body = [[_label(e), e["layout"], f"{e['size_gb']:.2f}", _f(e["median_s"]), _f(e["gbps"], "{:.2f}"),
                 _f(e["s_per_gb"]), _f(e["x_smallest"], "{:.2f}"), _f(e["min_s_per_gb"]), _mib(e["sender_peak_extra_bytes"]),
                 ",".join(_mib(b) for b in e["receivers_peak_extra_bytes"]) or "-",
                 _mib(e["node_shmem_extra_bytes"]), _mib(e["shm_bytes"])] for e in growth]
        widths = [max([len(c)] + [len(b[i]) for b in body]) for i, c in enumerate(cols)]
        lines += ["growth with model size (x smallest: s/GB over the same row's s/GB at the smallest size):",
                  "  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True))]
        lines += ["  ".join(v.ljust(w) for v, w in zip(b, widths, strict=True)) for b in body]
    for s in result.get("skipped") or []:
        bucket = f" {s['bucket_mb']:g}MiB" if s.get("bucket_mb") else ""
        lines.append(f"skipped {s['layout']} {s['name']}{bucket} x{s['receivers']}: {s['why'].removeprefix('skipped: ')}")
    return "\n".join(lines)


def write_plot(result: dict[str, Any], path: str) -> str | None:
    """Two panels against model size (GB): seconds per version and seconds per GB, one line
    per row configuration. Returns why not when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'weightsync[plot]')"
    lines: dict[str, list[dict[str, Any]]] = {}
    for e in result.get("growth") or []:
        lines.setdefault(_label(e), []).append(e)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.6))
    for label, points in lines.items():
        xs = [p["size_gb"] for p in points]
        left.plot(xs, [p["median_s"] for p in points], marker="o", label=label)
        right.plot(xs, [p["s_per_gb"] for p in points], marker="o", label=label)
        for p in points:
            left.annotate(p["layout"], (p["size_gb"], p["median_s"]), fontsize=7, xytext=(3, 3),
                          textcoords="offset points")
    left.set(xlabel="model size (GB)", ylabel="seconds per version (lower is better)", title="time per version")
    right.set(xlabel="model size (GB)", ylabel="seconds per GB", title="time per GB (flat = linear growth)")
    right.set_ylim(bottom=0)
    left.set_ylim(bottom=0)
    for ax in (left, right):
        ax.grid(alpha=0.3)
    left.legend(fontsize=8)
    m = result["machine"]
    fig.suptitle(f"weightsync bench growth: {m['cpu_count']} cores ({m['cpu_model']}), "
                 f"device={result['args']['device']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
