"""The user's run end to end on CPU (issue 24): verl's recipe at ccd7d934 from its source tree,
started with ``python -m weightsync_verl.one_step_off``, generating through verl's own async
vLLM server with vLLM's real CPU engine (scripts/verl_source.sh with WEIGHTSYNC_VERL_VLLM=cpu),
an FSDP2 actor on 2 CPU ranks; see e2e_run.py for the overrides. Every step's batch was
generated with the previous step's weights, and the actor's old_log_prob of its tokens (same
weights) matches the rollout's own log-probs within 1e-3 (fp32): weights the rollout serves,
prefix cache included, are the trainer's."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from .conftest import SRC
from .e2e_run import run

pytestmark = pytest.mark.verl_source

STEPS = 5
BOUND = 1e-3  # max abs, fp32 on both sides


def _real_vllm() -> bool:
    return importlib.util.find_spec("vllm") is not None and importlib.util.find_spec("vllm._C") is not None


@pytest.mark.skipif(not _real_vllm(), reason="needs vLLM's CPU engine in this venv: "
                    "WEIGHTSYNC_VERL_VLLM=cpu scripts/verl_source.sh ccd7d934 <dir>")
def test_user_run_generates_with_the_synced_weights(tmp_path: Path):
    if not Path(SRC, "recipe/one_step_off_policy/agent_loop").is_dir():
        pytest.skip("this generation's recipe has no async server path (agent_loop): ccd7d934 / v0.7.0 only")
    refusals = tmp_path / "nccl-refusals.txt"
    rows, _ = run(SRC, tmp_path, STEPS, extra_env={"E2E_NCCL_REFUSALS": str(refusals)})

    assert not refusals.exists(), f"an NCCL group was asked for: {refusals.read_text()}"
    steps = [int(r["step"]) for r in rows]
    assert steps == list(range(1, STEPS + 1)), f"verl logged steps {steps}"
    for r in rows:
        step = int(r["step"])
        # the batch trained at step s was generated with version s - 1 (one step off)
        assert r["weightsync/batch_version"] == step - 1, f"step {step}: batch tagged {r['weightsync/batch_version']}"
        assert r["weightsync/version"] == step, f"step {step}: synced version {r['weightsync/version']}"
        assert r["e2e/response_tokens"] > 0
        assert r["e2e/rollout_logprob_diff_max"] <= BOUND, (
            f"step {step}: rollout vs actor log-prob max abs diff {r['e2e/rollout_logprob_diff_max']:.3g}")
        assert r["training/rollout_probs_diff_max"] <= BOUND, (
            f"step {step}: verl's rollout_probs_diff_max {r['training/rollout_probs_diff_max']:.3g}")
