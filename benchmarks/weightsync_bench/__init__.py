"""``weightsync bench``, a program beside the package: sync throughput of the transports against
Ray's object store, a per-tensor collective broadcast and the machine's copy ceiling, measured in
one run.

Modules: cli (arguments, the run), interleave (rows in rotated rounds, load and CPU per
row, the other side of --against), rounds (pure: order, statistics, A/B table), actors
(trainer / rollout Ray actors), runner (rows), baseline_rows + collective_baselines,
ceiling, memory_fit, peak_memory, layout_source, results, expect, growth.

This file imports nothing, so a module of the bench that needs none of the bench extra's
packages (psutil, tqdm) imports without them.
"""
