"""Log-prob parity for fully-async batches, where one response may span weight versions.

What verl 0.9.1 records: per response, ``min_global_steps`` (the version of the first attempt)
and ``max_global_steps`` (the version of the last one); FullyAsyncLLMServerClient.generate
(verl/workers/rollout/llm_server.py) re-submits prompt + tokens so far after every abort, so a
response is a run of segments, each sampled by the vLLM engine under the weights it served
then, the versions non-decreasing. No per-token version is recorded.

What parity means here: every response token's rollout log-prob equals (within ``bound``) the
log-prob that a transformers forward pass over the whole sequence gives it under the weights
of *some* version, and those versions can be laid out as verl generates: non-decreasing
along the response, starting no lower than ``min_global_steps`` and ending at
``max_global_steps`` (the last attempt is never aborted and yields at least one token). A
resumed attempt prefills prompt + earlier tokens with the new weights, so the forward pass
over the whole sequence under a token's version is exactly what sampled it. A response of
one version is the special case min == max, compared against that version alone.
"""

from __future__ import annotations

import torch
import version_parity as vp


def assign_versions(diffs: dict[int, torch.Tensor], lo: int, hi: int, bound: float) -> list[int] | None:
    """One version per token, non-decreasing, in [lo, hi], the last one ``hi``, every token
    within ``bound`` under its version; None where no such layout exists. ``diffs[v]`` holds
    the per-token differences under version v. Of the layouts, the one that keeps each token
    on the latest version possible (so a token is put on an older version only when the
    newer ones do not explain it)."""
    versions = list(range(lo, hi + 1))
    n = len(diffs[hi])
    if n == 0:
        return []
    ok = [[diffs[v][t].item() <= bound for v in versions] for t in range(n)]
    # reach[t][j]: token t on versions[j] is consistent with some layout of tokens 0..t
    reach = []
    for t in range(n):
        row, seen = [], t == 0
        for j in range(len(versions)):
            seen = seen or (t > 0 and reach[t - 1][j])
            row.append(seen and ok[t][j])
        reach.append(row)
    if not reach[-1][-1]:
        return None
    layout, j = [0] * n, len(versions) - 1
    for t in range(n - 1, -1, -1):
        while not reach[t][j]:
            j -= 1
        layout[t] = versions[j]
    return layout


def check_batch(batch: dict, models: dict, bound: float) -> list[dict]:
    """Per response of ``batch``: its version span, the layout found (None: parity fails),
    the tokens per version in it, and two controls: the max difference against ``hi``'s
    weights alone (above ``bound`` for a response that truly mixes versions) and against the
    next version's (None where none was synced). ``models[v]`` is the transformers model with
    version v's weights."""
    lows, highs = batch["min_global_steps"], batch["max_global_steps"]
    needed = sorted({v for lo, hi in zip(lows, highs, strict=True) for v in range(lo, hi + 2) if v in models})
    per_version = {v: vp.token_diffs(models[v], batch) for v in needed}
    rows = []
    for i, (lo, hi) in enumerate(zip(lows, highs, strict=True)):
        diffs = {v: per_version[v][i] for v in range(lo, hi + 1)}
        layout = assign_versions(diffs, lo, hi, bound)
        worst = max((diffs[v][t].item() for t, v in enumerate(layout)), default=0.0) if layout is not None else None
        rows.append({"sample": i, "min": lo, "max": hi, "tokens": len(diffs[hi]),
                     "per_version": None if layout is None else {v: layout.count(v) for v in sorted(set(layout))},
                     "matched": worst,
                     "against_max_only": _worst(diffs[hi]),
                     "against_next": _worst(per_version[hi + 1][i]) if hi + 1 in per_version else None})
    return rows


def _worst(diffs: torch.Tensor) -> float:
    return diffs.max().item() if diffs.numel() else 0.0
