"""Internal. The bit-exact check every benchmark row ends with: a digest of a model's tensors, compared
between the trainer and each receiver. Its own module: the bench's actors and the collective
baselines' actors both use it, and neither should import the other for it."""

from __future__ import annotations

import torch
import xxhash


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def digest(tensors: dict[str, torch.Tensor]) -> str:
    """xxh3 over every tensor's bytes, in order: equal digests mean bit-exact weights."""
    h = xxhash.xxh3_64()
    for name, t in tensors.items():
        h.update(name.encode())
        if t.numel():
            h.update(memoryview(flat_bytes(t.detach().cpu().contiguous()).numpy()))
    return h.hexdigest()
