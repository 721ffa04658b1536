"""Per-step figures verl 0.9.1 does not log, added to the metrics of its own mismatch
function: loaded in every verl process by ``VERL_USE_EXTERNAL_MODULES`` (after
``cpu_platform``), it wraps ``verl.utils.debug.metrics.calculate_debug_metrics``, which the
trainer imports at each call (``SeparateRayPPOTrainer._fit_compute_log_prob``, when the actor
recomputes ``old_log_probs`` next to the rollout's ``rollout_log_probs``). Observation only:
verl's own metrics are returned unchanged, with these beside them:

- ``e2e/logprob_abs_diff_max`` / ``_mean``: |rollout log-prob - actor old_log_prob| over the
  response tokens (verl's ``training/rollout_probs_diff_*`` are the same on probabilities);
- ``e2e/min_global_steps`` / ``e2e/max_global_steps``: the weight versions the batch was
  generated with, as verl's vLLM server tags each output (``extra_fields["global_steps"]``,
  set by the checkpoint-engine update that installed the weights);
- ``e2e/response_tokens``: how many tokens were compared.
"""

from __future__ import annotations

import verl.utils.debug.metrics as _metrics

_verl_calculate = _metrics.calculate_debug_metrics


def calculate_debug_metrics(data):
    out = dict(_verl_calculate(data))
    rollout, actor = data.batch["rollout_log_probs"], data.batch["old_log_probs"]
    mask = data.batch["response_mask"][:, -rollout.shape[1]:].bool()
    diff = (rollout.float() - actor.float()).abs()[mask]
    out["e2e/logprob_abs_diff_max"] = diff.max().item() if diff.numel() else float("nan")
    out["e2e/logprob_abs_diff_mean"] = diff.mean().item() if diff.numel() else float("nan")
    out["e2e/response_tokens"] = int(mask.sum())
    steps = [s for key in ("min_global_steps", "max_global_steps") for s in data.non_tensor_batch.get(key, [])]
    steps = [int(s) for s in steps if s is not None]
    out["e2e/min_global_steps"] = min(steps) if steps else -1
    out["e2e/max_global_steps"] = max(steps) if steps else -1
    return out


_metrics.calculate_debug_metrics = calculate_debug_metrics
