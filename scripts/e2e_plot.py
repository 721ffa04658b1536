"""Figures of docs/end-to-end.md from the end-to-end run's logged metrics (verl's file logger,
one JSON line per step; tests/verl_source/e2e_run.py writes it).

    python scripts/e2e_plot.py <metrics.jsonl> docs/img/end-to-end.png

Draws the per-step reward and the rollout-vs-actor mismatch (log-probs, and verl's own
probability metric) and prints the Markdown table of verl's per-step timings for the page.
Needs matplotlib (the ``plot`` extra).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

TIMINGS = [("generate_async", "rollout generates batch (s)"), ("gen", "trainer waits for it (s)"),
           ("sync_rollout_weights", "weight sync (s)"), ("old_log_prob", "old_log_prob (s)"),
           ("update_actor", "update_actor (s)"), ("step", "step (s)")]


def load(path: Path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    out = []
    for r in rows:
        data = r.get("data", r)  # verl's FileLogger writes {"step": s, "data": {...}}
        out.append({"step": int(r.get("step", data.get("training/global_step", 0))), **data})
    return sorted(out, key=lambda r: r["step"])


def reward(r: dict) -> float:
    return r.get("critic/score/mean", r.get("critic/rewards/mean", float("nan")))


def table(rows: list[dict]) -> str:
    head = ["step", "batch version", "reward", "log-prob max abs diff", *(t for _, t in TIMINGS), "sync share of step"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        t = {k: r.get(f"timing_s/{k}", float("nan")) for k, _ in TIMINGS}
        cells = [str(r["step"]), f"{r.get('weightsync/batch_version', float('nan')):.0f}", f"{reward(r):.3f}",
                 f"{r.get('e2e/rollout_logprob_diff_max', float('nan')):.2e}",
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
    ax2.semilogy(steps, [r["e2e/rollout_logprob_diff_max"] for r in rows], marker="o", label="log-prob, max abs")
    ax2.semilogy(steps, [r["training/rollout_probs_diff_max"] for r in rows], marker="s",
                 label="verl rollout_probs_diff_max")
    ax2.axhline(1e-3, color="red", linestyle="--", label="1e-3")
    ax2.set(title="rollout vs actor old_log_prob", xlabel="step", ylabel="abs diff")
    ax2.legend(fontsize=8)
    for ax in (ax1, ax2):
        ax.set_xticks(steps)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def main() -> None:
    rows = load(Path(sys.argv[1]))
    plot(rows, Path(sys.argv[2]))
    print(table(rows))


if __name__ == "__main__":
    main()
