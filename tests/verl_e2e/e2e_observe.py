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

With ``VERL_E2E_RECORD`` set to a directory (run_verl.py sets it), it also records what the
tier's version-matched parity check needs (tests/verl_e2e/version_parity.py):

- ``batch-<n>.pt`` per call (n = 1, 2, ...: one per training step): each sample's
  ``input_ids`` / ``attention_mask`` (prompt + response), ``response_mask``,
  ``rollout_log_probs`` and the ``min/max_global_steps`` tags verl's vLLM server put on it;
- ``weights-<global_steps>.pt``: the full state dict actor rank 0 hands to weightsync's
  checkpoint engine at each sync (``send_weights``, tapped on the actor side: the trainer's
  weights are the truth), keyed by the ``global_steps`` verl passes with it, which is the tag
  the server puts on every batch generated after that sync; where the actor ranks hand their
  FSDP2 shards instead (weightsync_verl.engine_shards), ``shard-<global_steps>-<rank>.pt``
  from every rank: each tensor's local rows and where they start;
- ``received-<version>-<pid>.json`` per rollout worker and sync: the version weightsync's
  receiver served (``served``), the ``global_steps`` verl passed, the tensor count.
"""

from __future__ import annotations

import itertools
import json
import os

import torch
import verl.utils.debug.metrics as _metrics
from weightsync_verl.checkpoint_engine import WeightSyncCheckpointEngine

RECORD = os.environ.get("VERL_E2E_RECORD")

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
    if RECORD:
        _record_batch(data)
    return out


_calls = itertools.count(1)


def _record_batch(data, **extra) -> None:
    """Writes the next ``batch-<n>.pt`` (``extra``: more fields of the caller's, e.g. the
    trainer's weight version when it took the batch)."""
    keep = ("input_ids", "attention_mask", "response_mask", "rollout_log_probs")
    record = {key: data.batch[key].detach().cpu().clone() for key in keep} | extra
    for key in ("min_global_steps", "max_global_steps"):
        tags = data.non_tensor_batch.get(key)
        record[key] = None if tags is None else [None if t is None else int(t) for t in tags]
    torch.save(record, os.path.join(RECORD, f"batch-{next(_calls)}.pt"))


_send_weights = WeightSyncCheckpointEngine.send_weights


async def send_weights(self, weights, global_steps=None):
    """weightsync's send_weights with what this rank hands it copied as it is staged: rank 0's
    pairs where they are whole tensors, every rank's own rows where they are FSDP2 shards."""
    if not RECORD:
        return await _send_weights(self, weights, global_steps=global_steps)
    whole: dict[str, torch.Tensor] = {}
    rows: dict[str, dict] = {}

    def tap():
        for name, tensor in weights:
            if hasattr(tensor, "to_local"):
                rows[name] = _rows_of(tensor)
            elif self.is_master:
                whole[name] = tensor.detach().to("cpu", copy=True)
            yield name, tensor

    out = await _send_weights(self, tap(), global_steps=global_steps)
    # the sync of a version staged ahead reads no tensors: the ahead call recorded them
    if whole:
        torch.save(whole, os.path.join(RECORD, f"weights-{global_steps}.pt"))
    if rows:
        rank = torch.distributed.get_rank()
        torch.save(rows, os.path.join(RECORD, f"shard-{global_steps}-{rank}.pt"))
    return out


def _rows_of(dt) -> dict:
    """A row-sharded DTensor's local rows, where they start in the full tensor, and its shape."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(dt.shape, dt.device_mesh, dt.placements)
    start = offset[0] if offset else 0
    return {"rows": dt.to_local().detach().to("cpu", copy=True), "start": int(start), "shape": tuple(dt.shape)}


_receive_weights = WeightSyncCheckpointEngine.receive_weights


async def receive_weights(self, global_steps=None):
    """weightsync's receive_weights; once a version is complete, ``received-<version>.json``
    says which version weightsync delivered to this rollout worker and how many tensors."""
    count = 0
    async for pair in _receive_weights(self, global_steps=global_steps):
        count += 1
        yield pair
    if RECORD:
        with open(os.path.join(RECORD, f"received-{self.served}-{os.getpid()}.json"), "w") as f:
            json.dump({"served": self.served, "global_steps": global_steps, "tensors": count}, f)


_metrics.calculate_debug_metrics = calculate_debug_metrics
WeightSyncCheckpointEngine.send_weights = send_weights
WeightSyncCheckpointEngine.receive_weights = receive_weights
