"""Figures of docs/end-to-end.md from the end-to-end run's logged metrics (verl's file logger,
one JSON line per step; tests/verl_source/e2e_run.py writes it, and parity.jsonl beside it).

    python scripts/e2e_plot.py <metrics.jsonl> docs/img/end-to-end.png

Draws the per-step reward and the rollout's log-prob mismatch (against the weights of the
batch's own version, the next version's, and verl's old_log_prob) and prints the Markdown
tables of the per-step mismatch and of verl's per-step timings for the page.
Needs matplotlib (the ``plot`` extra).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

TIMINGS = [("generate_async", "rollout generates batch (s)"), ("gen", "trainer waits for it (s)"),
           ("sync_rollout_weights", "weight sync (s)"), ("old_log_prob", "old_log_prob (s)"),
           ("update_actor", "update_actor (s)"), ("step", "step (s)")]


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def load(path: Path) -> list[dict]:
    out = []
    for r in _lines(path):
        data = r.get("data", r)  # verl's FileLogger writes {"step": s, "data": {...}}
        out.append({"step": int(r.get("step", data.get("training/global_step", 0))), **data})
    beside = path.parent / "parity.jsonl"
    parity = {p["step"]: p for p in _lines(beside)} if beside.exists() else {}
    for r in out:
        r.update({f"parity/{k}": v for k, v in parity.get(r["step"], {}).items()})
    return sorted(out, key=lambda r: r["step"])


def mismatch_table(rows: list[dict]) -> str:
    head = ["step", "batch version", "response tokens", "vs its version's weights", "vs the next version's",
            "vs verl's old_log_prob"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    nan = float("nan")
    for r in rows:
        cells = [str(r["step"]), f"{r.get('weightsync/batch_version', nan):.0f}", str(r.get("parity/tokens", "")),
                 f"{r.get('parity/version_matched_max', nan):.2e}", f"{r.get('parity/next_version_max', nan):.2e}",
                 f"{r.get('e2e/rollout_logprob_diff_max', nan):.2e}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def reward(r: dict) -> float:
    return r.get("critic/score/mean", r.get("critic/rewards/mean", float("nan")))


def table(rows: list[dict]) -> str:
    head = ["step", "batch version", "reward", *(t for _, t in TIMINGS), "sync share of step"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        t = {k: r.get(f"timing_s/{k}", float("nan")) for k, _ in TIMINGS}
        cells = [str(r["step"]), f"{r.get('weightsync/batch_version', float('nan')):.0f}", f"{reward(r):.3f}",
                 *(f"{t[k]:.2f}" for k, _ in TIMINGS), f"{t['sync_rollout_weights'] / t['step']:.1%}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.4))
    ax1.plot(steps, [reward(r) for r in rows], marker="o")
    ax1.set(title="reward per step (mean over the batch)", xlabel="step", ylabel="reward")
    nan = float("nan")
    ax2.semilogy(steps, [r.get("parity/version_matched_max", nan) for r in rows], marker="o",
                 label="its version's weights (HF fp32)")
    ax2.semilogy(steps, [r.get("parity/next_version_max", nan) for r in rows], marker="^",
                 label="next version's weights (control)")
    ax2.semilogy(steps, [r["e2e/rollout_logprob_diff_max"] for r in rows], marker="s", linestyle=":",
                 label="verl's old_log_prob")
    ax2.axhline(1e-3, color="red", linestyle="--", label="1e-3")
    ax2.set(title="rollout log-probs of its tokens vs (max abs)", xlabel="step", ylabel="abs diff")
    ax2.legend(fontsize=8)
    for ax in (ax1, ax2):
        ax.set_xticks(steps)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def main() -> None:
    rows = load(Path(sys.argv[1]))
    plot(rows, Path(sys.argv[2]))
    print(mismatch_table(rows), table(rows), sep="\n\n")


if __name__ == "__main__":
    main()
