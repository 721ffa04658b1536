"""Delta encoding of packed buckets: pure functions over uint8 bucket tensors.

Between two RL steps most bf16 weights keep their bits, so a bucket of version v is sent as
the smallest of: nothing (``SKIP``: no word changed), the changed words (``SPARSE``:
positions + new values) or the whole bucket (``FULL``), against the same bucket of the last
committed version. Words are 2 bytes whatever the tensors' dtypes (an odd-length bucket uses
1-byte words), so one rule serves bf16, fp16, fp32 (the low half changes, the high half
rarely) and integer tensors alike.

Sparse wire form, little-endian: ``[count: int64][word: int64][positions: int32 x count]
[values: word bytes x count]``. Positions are word indices, strictly increasing. Decoding
checks the header, the length and the positions before writing a byte, so a mangled
encoding raises DeltaError instead of writing outside the bucket.

Applying returns an undo record (the positions and the words they held, or the whole old
bucket for FULL): as large as the delta, it restores the bucket when the version fails.
"""

from __future__ import annotations

import dataclasses

import torch

from .errors import WeightSyncError

SKIP, SPARSE, FULL = "skip", "sparse", "full"
KINDS = (SKIP, SPARSE, FULL)
HEADER = 16
# auto: a version goes as a delta only when the encoded buckets are at most this share of the
# payload; above it, the diffing, the sparse writes and the digest of the rebuilt bucket at every
# receiver cost more than the bytes saved (docs/delta.md)
AUTO_SHARE = 0.5
_MAX_WORDS = 2**31 - 1  # positions are int32


class DeltaError(WeightSyncError):
    """A delta does not apply: malformed, or the bucket it rebuilt differs from the sender's."""


def snapshot_bytes(bucket_count: int, bucket_bytes: int) -> int:
    """Host memory the trainer keeps for delta sync: the snapshot at bucket stride plus one
    scratch bucket (a receiver's shadow: one bucket less)."""
    return (bucket_count + 1) * bucket_bytes


def word_dtype(nbytes: int) -> torch.dtype:
    """The word the bucket is compared in: 2 bytes, or 1 for an odd length."""
    return torch.int16 if nbytes % 2 == 0 else torch.uint8


def changed(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Word positions (int64, increasing) where the uint8 buckets ``old`` and ``new`` differ."""
    if old.numel() != new.numel():
        raise ValueError(f"buckets of {old.numel()} and {new.numel()} bytes cannot be compared")
    w = word_dtype(new.numel())
    return torch.nonzero(old.view(w) != new.view(w)).flatten()


def sparse_bytes(count: int, nbytes: int) -> int:
    """Encoded length of ``count`` changed words of a bucket of ``nbytes``."""
    return HEADER + count * (4 + word_dtype(nbytes).itemsize)


def choose(count: int, nbytes: int) -> str:
    """The smallest encoding of a bucket with ``count`` changed words."""
    if count == 0:
        return SKIP
    if nbytes // word_dtype(nbytes).itemsize > _MAX_WORDS or sparse_bytes(count, nbytes) >= nbytes:
        return FULL
    return SPARSE


def encode_sparse(new: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The sparse wire form of the words of ``new`` at ``positions``."""
    w = word_dtype(new.numel())
    count = positions.numel()
    out = torch.empty(sparse_bytes(count, new.numel()), dtype=torch.uint8)
    out[:HEADER].view(torch.int64).copy_(torch.tensor([count, w.itemsize], dtype=torch.int64))
    pos_end = HEADER + 4 * count
    out[HEADER:pos_end].view(torch.int32).copy_(positions)
    out[pos_end:].view(w).copy_(new.view(w)[positions])
    return out


def encode(old: torch.Tensor | None, new: torch.Tensor) -> tuple[str, torch.Tensor | None]:
    """(kind, payload) of bucket ``new`` against ``old`` (None: no base, FULL). The FULL
    payload is ``new`` itself, not a copy; SKIP has none."""
    if old is None:
        return FULL, new
    pos = changed(old, new)
    kind = choose(pos.numel(), new.numel())
    if kind == SPARSE:
        return kind, encode_sparse(new, pos)
    return kind, (new if kind == FULL else None)


def _parse(payload: torch.Tensor, nbytes: int, where: str) -> tuple[torch.Tensor, torch.Tensor, torch.dtype]:
    if payload.numel() < HEADER:
        raise DeltaError(f"{where}: sparse delta of {payload.numel()} bytes is shorter than its header")
    count, word = (int(x) for x in payload[:HEADER].view(torch.int64).tolist())
    w = word_dtype(nbytes)
    if word != w.itemsize or count < 0 or payload.numel() != sparse_bytes(count, nbytes):
        raise DeltaError(f"{where}: sparse delta header (count {count}, word {word}) does not fit its "
                         f"{payload.numel()} bytes for a bucket of {nbytes}")
    pos_end = HEADER + 4 * count
    pos = payload[HEADER:pos_end].view(torch.int32).long()
    if count and (int(pos[0]) < 0 or int(pos[-1]) >= nbytes // w.itemsize or bool((pos[1:] <= pos[:-1]).any())):
        raise DeltaError(f"{where}: sparse delta positions are out of the bucket or out of order")
    return pos, payload[pos_end:].view(w), w


@dataclasses.dataclass
class Undo:
    """What applying one bucket's delta overwrote: ``positions`` (None: the whole bucket) and
    the old words (or bytes)."""

    positions: torch.Tensor | None
    values: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.values.numel() * self.values.element_size() + (
            0 if self.positions is None else self.positions.numel() * 8)


def apply(bucket: torch.Tensor, kind: str, payload: torch.Tensor | None, where: str = "bucket") -> Undo | None:
    """Apply one bucket's delta to ``bucket`` (uint8, host) in place; the undo record, or
    None when nothing was written (SKIP)."""
    if kind == SKIP:
        if payload is not None and payload.numel():
            raise DeltaError(f"{where}: a skipped bucket carries {payload.numel()} bytes")
        return None
    if payload is None:
        raise DeltaError(f"{where}: {kind} delta without payload")
    if kind == FULL:
        if payload.numel() != bucket.numel():
            raise DeltaError(f"{where}: full bucket of {payload.numel()} bytes, the plan says {bucket.numel()}")
        undo = Undo(None, bucket.clone())
        bucket.copy_(payload)
        return undo
    if kind != SPARSE:
        raise DeltaError(f"{where}: unknown delta kind {kind!r}")
    pos, values, w = _parse(payload, bucket.numel(), where)
    words = bucket.view(w)
    undo = Undo(pos, words[pos].clone())
    words[pos] = values
    return undo


def revert(bucket: torch.Tensor, undo: Undo | None) -> None:
    """Put back what ``apply`` overwrote."""
    if undo is None:
        return
    if undo.positions is None:
        bucket.copy_(undo.values)
    else:
        bucket.view(undo.values.dtype)[undo.positions] = undo.values


def pays(encoded: int, payload: int, mode: str) -> bool:
    """Whether a version whose buckets encode to ``encoded`` bytes of ``payload`` goes as a
    delta: always for ``on``, under AUTO_SHARE of the payload for ``auto``, never for ``off``."""
    if mode == "on":
        return True
    if mode == "auto":
        return encoded <= AUTO_SHARE * payload
    return False
