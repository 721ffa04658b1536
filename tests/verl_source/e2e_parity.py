"""The end-to-end run's logprob parity, per step and per weight version (issue 24, item 3).

One-step-off generates batch s with version s - 1 while verl's ``old_log_prob`` of that batch
uses the actor after one more update, so verl's own mismatch metric compares two different
policies from step 2 on. The check here compares like with like: each batch's rollout
log-probs against an HF ``Qwen2ForCausalLM`` (fp32, eager attention) loaded with the state
dict the actor sent for the version the batch is tagged with, both as recorded during the run
by e2e_site/sitecustomize.py (``E2E_CAPTURE_DIR``). The same forward with the next version's
weights is the control: it must differ, or the check could not fail.
"""

from __future__ import annotations

from pathlib import Path

import torch


def model_at(model_dir: Path, weights: dict[str, torch.Tensor]):
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    # strict: every parameter of the model comes from what the actor sent, nothing from disk
    model.load_state_dict(weights, strict=True)
    return model.eval()


@torch.no_grad()
def response_log_probs(model, batch: dict) -> torch.Tensor:
    """Log-probs of every response token (zeros past the response mask), one unpadded
    sequence at a time: verl left-pads prompts and right-pads responses."""
    prompts, responses = batch["prompts"], batch["responses"]
    width = prompts.size(1)
    mask = batch["response_mask"][:, -responses.size(1):].bool()
    prompt_mask = batch["attention_mask"][:, :width].bool()
    out = torch.zeros(responses.shape, dtype=torch.float32)
    for i in range(prompts.size(0)):
        prompt = prompts[i][prompt_mask[i]]
        length = int(mask[i].sum())
        ids = torch.cat([prompt, responses[i][:length]]).unsqueeze(0)
        logits = model(input_ids=ids).logits[0, prompt.numel() - 1:-1].float()
        out[i, :length] = torch.log_softmax(logits, -1).gather(-1, responses[i][:length, None]).squeeze(-1)
    return out


def max_abs(a: torch.Tensor, b: torch.Tensor, batch: dict) -> float:
    mask = batch["response_mask"][:, -batch["responses"].size(1):].bool()
    return torch.masked_select((a.float() - b.float()).abs(), mask).max().item()


def per_step(capture: Path, model_dir: Path) -> list[dict]:
    """For every recorded batch n (= step n): its tag, and the max abs diff of the rollout's
    log-probs against the HF forward with the tagged version's weights and with the next
    version's; also the HF forward with the next version against verl's old_log_prob (the
    actor holds that version when it computes old_log_prob)."""
    rows, models = [], {}

    def at(version: int):
        if version not in models:
            weights = torch.load(capture / f"weights-v{version}.pt", weights_only=True)
            models[version] = model_at(model_dir, weights)
        return models[version]

    n = 1
    while (capture / f"batch-{n}.pt").exists():
        batch = torch.load(capture / f"batch-{n}.pt", weights_only=True)
        tag = batch["weight_version"]
        rollout, old = batch["rollout_log_probs"], batch["old_log_probs"]
        same = response_log_probs(at(tag), batch)
        row = {"step": n, "tag": tag, "version_matched_max": max_abs(same, rollout, batch),
               "old_log_prob_max": max_abs(old, rollout, batch),
               "tokens": int(batch["response_mask"][:, -batch["responses"].size(1):].sum())}
        if (capture / f"weights-v{tag + 1}.pt").exists():
            following = response_log_probs(at(tag + 1), batch)
            row["next_version_max"] = max_abs(following, rollout, batch)
            row["next_version_vs_old_log_prob_max"] = max_abs(following, old, batch)
        rows.append(row)
        n += 1
    return rows
