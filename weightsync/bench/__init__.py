"""``weightsync bench``: sync throughput of the transports against Ray's object store, a
per-tensor collective broadcast and the machine's copy ceiling, measured in one run.

Modules: cli (arguments, the run), actors (trainer / rollout Ray actors), runner (rows),
collective baselines (collective_baselines, driven by baseline_rows), ceiling, peak_memory,
memory_fit, layout_source, results (table, JSON, plot), growth, expect.
"""

from .cli import add_bench_arguments, run_bench

__all__ = ["add_bench_arguments", "run_bench"]
