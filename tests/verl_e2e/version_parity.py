"""The version-matched parity check of the verl-e2e run: each batch's rollout log-probs
against a transformers forward pass with the trainer's weights of the version the batch was
generated with (e2e_observe records both in ``OUT/record``).

Why not verl's ``old_log_prob``: one-step-off scores batch s with the actor after s - 1
updates while the rollout generated it with the weights synced before the previous update
(policy lag by design), so only step 1 compares equal weights there. Here the reference is
the state dict the actor ranks handed to weightsync for the batch's ``global_steps`` tag, run
through ``Qwen2ForCausalLM`` in fp32 with eager attention, one unpadded sequence at a time.
"""

from __future__ import annotations

import glob
import os
import re

import torch


def batches(record: str) -> list[dict]:
    """The recorded batches in step order (batch-1.pt is step 1)."""
    paths = glob.glob(os.path.join(record, "batch-*.pt"))
    paths.sort(key=lambda p: int(re.search(r"batch-(\d+)\.pt$", p).group(1)))
    return [torch.load(p, weights_only=True) for p in paths]


def versions(record: str) -> list[int]:
    whole = {int(re.search(r"weights-(\d+)\.pt$", p).group(1)) for p in glob.glob(os.path.join(record, "weights-*.pt"))}
    sharded = {int(re.search(r"shard-(\d+)-\d+\.pt$", p).group(1)) for p in glob.glob(os.path.join(record, "shard-*.pt"))}
    return sorted(whole | sharded)


def state_of(record: str, version: int) -> dict[str, torch.Tensor]:
    """The state dict the actor synced as ``version``: rank 0's whole tensors, or every rank's
    rows put together (each row of every tensor written by exactly one rank)."""
    path = os.path.join(record, f"weights-{version}.pt")
    if os.path.exists(path):
        return torch.load(path, weights_only=True)
    state: dict[str, torch.Tensor] = {}
    written: dict[str, int] = {}
    for shard in sorted(glob.glob(os.path.join(record, f"shard-{version}-*.pt"))):
        for name, r in torch.load(shard, weights_only=True).items():
            full = state.setdefault(name, torch.empty(r["shape"], dtype=r["rows"].dtype))
            full[r["start"]:r["start"] + r["rows"].shape[0]] = r["rows"]
            written[name] = written.get(name, 0) + r["rows"].shape[0]
    short = {n: (k, state[n].shape[0]) for n, k in written.items() if k != state[n].shape[0]}
    if short:
        raise AssertionError(f"version {version}: rows written != rows of the tensor: {short}")
    return state


def batch_tag(batch: dict) -> int:
    """The one weight version every sample of the batch was generated with."""
    tags = set(batch["min_global_steps"]) | set(batch["max_global_steps"])
    if len(tags) != 1 or None in tags:
        raise AssertionError(f"a batch generated with several or unknown versions: {sorted(tags, key=str)}")
    return tags.pop()


def model_with(model_dir: str, record: str, version: int):
    """The tiny Qwen2 of the run with the state dict synced as ``version`` (every key, strict)."""
    from transformers import AutoConfig, Qwen2ForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    config._attn_implementation = "eager"
    model = Qwen2ForCausalLM(config).to(torch.float32).eval()
    state = state_of(record, version)
    model.load_state_dict({k: v.to(torch.float32) for k, v in state.items()}, strict=True)
    return model


def max_abs_diff(model, batch: dict) -> tuple[float, int]:
    """(max |rollout log-prob - model log-prob| over the response tokens, tokens compared)."""
    diffs = token_diffs(model, batch)
    worst = max((d.max().item() for d in diffs if d.numel()), default=0.0)
    return worst, sum(d.numel() for d in diffs)


@torch.no_grad()
def token_diffs(model, batch: dict) -> list[torch.Tensor]:
    """Per sample, |rollout log-prob - model log-prob| of each response token the response
    mask keeps, in order. verl lays out [left-padded prompt | right-padded response]; the
    valid tokens of a sample are contiguous, and the response's token j is predicted at its
    position - 1."""
    rollout = batch["rollout_log_probs"].float()
    width = rollout.shape[1]
    out = []
    for i in range(rollout.shape[0]):
        ids, attn = batch["input_ids"][i], batch["attention_mask"][i].bool()
        resp_mask = batch["response_mask"][i][-width:].bool()
        prompt_len = int(attn[:-width].sum())
        n = int(attn[-width:].sum())
        seq = ids[attn].unsqueeze(0)
        logits = model(input_ids=seq).logits[0].float()
        logp = torch.log_softmax(logits, dim=-1)
        targets = seq[0, prompt_len:prompt_len + n]
        ours = logp[prompt_len - 1:prompt_len - 1 + n].gather(1, targets.unsqueeze(1)).squeeze(1)
        if not resp_mask[n:].logical_not().all():
            raise AssertionError(f"sample {i}: response mask beyond the attended response")
        out.append((ours - rollout[i, :n]).abs()[resp_mask[:n]])
    return out
