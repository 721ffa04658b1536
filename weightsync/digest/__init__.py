"""Internal. Bucket digests: one per bucket per transport, checked by every receiver before it loads.

Two kinds:

- ``xxh3``: xxh3-64 of the bucket's bytes on the host. The fastest choice for host memory
  (one pass, SIMD, hashed from cache while the bucket is packed), but a device bucket
  would need a copy to host first.
- ``torch``: a 64-bit position-weighted sum computed with torch ops on the bucket's own
  device (CPU, CUDA, NPU alike), so NCCL / HCCL broadcast and device IPC are verified end
  to end without moving a byte to the host.

``auto`` (the config default) picks xxh3 for buckets in host memory and torch for device
buckets; docs/digest.md has the measurements behind that choice.

The torch digest. The bucket is read as little-endian int32 words, zero-padded at the end,
in rows of COLS words: x[r, c]; rot(x) is x with its two 16-bit halves swapped. With odd
pseudo-random weights that depend only on the position (so every device and every
chunking computes the same value):
    lane_1[r, c] = x[r, c] * A_1[c]       mod 2**32, as a signed int32
    lane_2[r, c] = rot(x[r, c]) * A_2[c]  mod 2**32, as a signed int32
    s_k[r]       = sum_c lane_k[r, c]            exact in int64 (|s_k| < 2**48)
    D            = n * LENGTH_MIX + sum_r R[r] * (s_1[r] + 2**32 * s_2[r])   mod 2**64
Why it catches what a transport can do wrong:
- a change confined to one word (a flipped bit, one corrupted word) changes s_1[r] by some
  d with 0 < |d| < 2**32 (A_1 odd), so the row term moves by R[r] * (d + 2**32 * d2), whose
  lowest set bit is d's, below bit 32; R[r] is odd: D always changes;
- 4-byte words, not 8-byte ones, keep every lane difference below 2**32 for that reason;
- several words changed in one row (swapped words, a torn stretch) move s_1 and s_2 by
  sums of lane differences that wrap mod 2**32, so they are not linear in the data: both
  must cancel for D to stay, about 2**-64 for data not chosen against the tables. A
  multiply mod 2**32 carries a change only upwards: words that differ only in bit 31 (a
  sign bit) differ only in bit 31 of lane 1 too, and a few such differences cancel easily.
  rot() moves bit 31 to bit 15 for lane 2, where the multiply spreads it over 17 bits;
- changes spread over rows (a stale bucket from the previous version, a zeroed tail, a
  shifted copy) must cancel in a sum weighted by the independent odd 64-bit R[r]: about
  2**-63 whenever the low bits of some row's change move, as real weight updates do.
It is a checksum against faults, not a MAC: it does not resist a crafted collision.
Cost: on a device, per chunk and lane one int32 multiply and one contiguous row sum, and one
half-word swap (see DEVICE_ROW_SUMS: about 13x one device copy on an H200); on the host a
half-word swap and two multiplies into a reused buffer (see ROW_SUMS); one small combination
per bucket; no host transfer until the value is read.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch
import xxhash

from ..errors import ChecksumError, ConfigError
from . import kernel

KINDS = ("xxh3", "torch")
CHOICES = ("auto", "xxh3", "torch", "off")
MASK = (1 << 64) - 1
COLS = 1 << 16  # weights per row: the column table is 512 KiB per device
LENGTH_MIX = 0x9E3779B97F4A7C15  # the byte length enters D too: buckets of other sizes differ
# words digested per step: the int64 products of one step stay in L2 on a CPU; on a device a
# step is one kernel launch per op, so there it is larger (fewer launches; 128 MiB of int32
# scratch per thread and device). On an H200, 16 Mi words summed 1.17 GiB in 8.1 ms, 4 Mi in
# 13.7 ms (benchmarks/digest_device.py, 7 interleaved repetitions)
CHUNK_WORDS = {"cpu": 1 << 18}
DEVICE_CHUNK_WORDS = 1 << 24
_SEED_COL, _SEED_ROW = 0x5753594E43434F4C, 0x5753594E43524F57


def resolve(choice: str, checksum: bool, device: torch.device | str) -> str | None:
    """The digest kind for buckets that live on ``device``; None: no digest.
    ``checksum: false`` (the older switch) is ``off``."""
    if choice not in CHOICES:
        raise ConfigError(f"digest must be one of {', '.join(CHOICES)}; got {choice!r}")
    if not checksum or choice == "off":
        return None
    if choice != "auto":
        return choice
    kind = device.type if isinstance(device, torch.device) else str(device).split(":")[0]
    return "xxh3" if kind == "cpu" else "torch"


def kind_of(config: Any, device: torch.device | str) -> str | None:
    """``resolve`` for a SyncConfig (one written before the ``digest`` field means auto)."""
    return resolve(getattr(config, "digest", "auto"), bool(config.checksum), device)


# -- xxh3 -------------------------------------------------------------------------------------

def xxh3(buf: torch.Tensor) -> int:
    """xxh3-64 of a uint8 buffer, without copying it when it is on the host."""
    if buf.device.type != "cpu":
        buf = buf.cpu()
    return xxhash.xxh3_64_intdigest(memoryview(buf.numpy()))


# -- the torch digest -------------------------------------------------------------------------

def _splitmix(seed: int, start: int, count: int) -> np.ndarray:
    """Odd pseudo-random 64-bit values for indices [start, start + count), as int64."""
    with np.errstate(over="ignore"):
        z = (np.arange(start, start + count, dtype=np.uint64) + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)
        z += np.uint64(seed)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
    return (z | np.uint64(1)).view(np.int64)


class _Tables:
    """Weight tables of one device, grown (never changed) as larger buckets come."""

    def __init__(self, device: torch.device):
        self.device = device
        lanes = _splitmix(_SEED_COL, 0, 2 * COLS).view(np.uint64) & np.uint64(0xFFFFFFFF)
        # two odd 32-bit weights per column, as the int32 with the same bits
        self.cols = torch.from_numpy(lanes.astype(np.uint32).view(np.int32).reshape(2, COLS).copy()).to(device)
        self.rows = torch.empty(0, dtype=torch.int64, device=device)
        self.pairs = self.cols.T.contiguous()  # (COLS, 2): A_1[c], A_2[c] as [x, rot(x)] are laid out

    def rows_upto(self, n: int) -> torch.Tensor:
        if self.rows.numel() < n:
            grown = max(n, 2 * self.rows.numel(), 64)
            self.rows = torch.from_numpy(_splitmix(_SEED_ROW, 0, grown)).to(self.device)
        return self.rows


_tables: dict[torch.device, _Tables] = {}
_tables_lock = threading.Lock()
_scratch = threading.local()  # per thread: prefetch() may digest beside apply()


def _tables_for(device: torch.device) -> _Tables:
    with _tables_lock:
        t = _tables.get(device)
        if t is None:
            t = _tables[device] = _Tables(device)
        return t


def _scratch_for(device: torch.device, layout: str, rows: int) -> torch.Tensor:
    """An int32 buffer per thread, device and layout for ``rows`` rows: "swap" (3, rows, COLS)
    for lane 1, lane 2 and rot(x); "flat" (2, rows, COLS) for lane 1 and rot(x), then lane 2;
    "pairs" (rows, COLS, 2) for [x, rot(x)], then its lanes."""
    cache = getattr(_scratch, "bufs", None)
    if cache is None:
        cache = _scratch.bufs = {}
    key = (device, layout)
    buf = cache.get(key)
    planes = {"swap": 3, "flat": 2}.get(layout)
    have = -1 if buf is None else buf.shape[1] if planes else buf.shape[0]
    if have < rows:
        shape = (planes, rows, COLS) if planes else (rows, COLS, 2)
        buf = cache[key] = torch.empty(shape, dtype=torch.int32, device=device)
    return buf[:, :rows] if planes else buf[:rows]


def _row_sums_swap(block: torch.Tensor, tables: _Tables, out: torch.Tensor) -> None:
    """(s_1, s_2) of each row of ``block`` into ``out``: the host's way. A host step is
    L2-resident (CHUNK_WORDS), so reading it again per op costs little, and elementwise shifts
    vectorize better on a CPU than the index_select of :func:`_row_sums_pairs`."""
    scratch = _scratch_for(block.device, "swap", block.shape[0])  # lane 1, lane 2, rot(x)
    torch.mul(block, tables.cols[0], out=scratch[0])
    torch.mul(_rot(block, out=scratch[2]), tables.cols[1], out=scratch[1])
    out.copy_(scratch[:2].sum(-1).T)


# the int16 halves of a word (lo, hi) picked as (lo, hi, hi, lo): read as two int32 words,
# that is x then rot(x), made in one pass over the bucket
_PAIR = (0, 1, 1, 0)
_pair_index: dict[torch.device, torch.Tensor] = {}


def _row_sums_pairs(block: torch.Tensor, tables: _Tables, out: torch.Tensor) -> None:
    """(s_1, s_2) of each row of ``block`` into ``out``: a device's way, three passes where
    the swap takes seven, and the bucket's bytes read once (into [x, rot(x)]); a device step
    is far larger than its caches, so every extra read is one more trip through memory."""
    idx = _pair_index.get(block.device)
    if idx is None:
        idx = _pair_index[block.device] = torch.tensor(_PAIR, dtype=torch.int64, device=block.device)
    pairs = _scratch_for(block.device, "pairs", block.shape[0])
    halves = block.view(torch.int16).view(*block.shape, 2)
    torch.index_select(halves, -1, idx, out=pairs.view(torch.int16).view(*block.shape, 4))
    torch.mul(pairs, tables.pairs, out=pairs)  # both lanes, in place
    torch.sum(pairs, dim=1, dtype=torch.int64, out=out)


def _row_sums_flat(block: torch.Tensor, tables: _Tables, out: torch.Tensor) -> None:
    """(s_1, s_2) of each row of ``block`` into ``out``, a lane at a time: every reduction runs
    along contiguous int32 words (the pairs way reduces over a strided middle axis), and rot(x)
    is two strided half-word copies instead of an index_select."""
    scratch = _scratch_for(block.device, "flat", block.shape[0])
    lane, rot = scratch[0], scratch[1]
    torch.mul(block, tables.cols[0], out=lane)
    out[:, 0] = lane.sum(1, dtype=torch.int64)
    halves = block.view(torch.int16).view(*block.shape, 2)
    swapped = rot.view(torch.int16).view(*block.shape, 2)
    swapped[..., 0].copy_(halves[..., 1])
    swapped[..., 1].copy_(halves[..., 0])
    torch.mul(rot, tables.cols[1], out=rot)
    out[:, 1] = rot.sum(1, dtype=torch.int64)


# how each device kind sums its rows (the same value every way: tests/test_digest.py). A device
# takes the flat way: on an H200 it digested 1.17 GiB at 154 GB/s, the pairs way at 98 GB/s,
# the swap way at 144 GB/s (benchmarks/digest_device.py; docs/digest.md)
ROW_SUMS = {"cpu": _row_sums_swap}
DEVICE_ROW_SUMS = _row_sums_flat


def _words(buf: torch.Tensor) -> torch.Tensor:
    """The whole int32 words of a uint8 buffer, as a view where the buffer is 4-byte aligned."""
    body = buf[: buf.numel() // 4 * 4]
    if body.storage_offset() % 4:
        body = body.clone()  # an odd start; buckets never have one, slices of them might
    return body.view(torch.int32)


def _rot(words: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """int32 words with their 16-bit halves swapped."""
    out = torch.bitwise_left_shift(words, 16, out=out)
    return out.bitwise_or_(torch.bitwise_right_shift(words, 16).bitwise_and_(0xFFFF))


def torch_digest(buf: torch.Tensor) -> torch.Tensor:
    """The digest of a 1-D uint8 buffer as a 0-dim int64 tensor on the buffer's device (no
    host synchronization: read it with :func:`as_int` when it is needed)."""
    if buf.dim() != 1 or buf.dtype != torch.uint8:
        raise TypeError(f"torch_digest needs a 1-D uint8 tensor, got {buf.dtype} of shape {tuple(buf.shape)}")
    device, n = buf.device, buf.numel()
    words = _words(buf)
    if kernel.enabled(device):
        return kernel.digest(words, buf, n, _tables_for(device), _signed(n * LENGTH_MIX), COLS)
    nw = words.numel()
    full_rows, rest = divmod(nw, COLS)
    tail = n - nw * 4
    nrows = full_rows + (1 if rest or tail else 0)
    tables = _tables_for(device)
    cols = tables.cols
    sums = torch.zeros((max(nrows, 1), 2), dtype=torch.int64, device=device)
    step = max(1, CHUNK_WORDS.get(device.type, DEVICE_CHUNK_WORDS) // COLS)
    row_sums = ROW_SUMS.get(device.type, DEVICE_ROW_SUMS)
    for r0 in range(0, full_rows, step):
        r1 = min(full_rows, r0 + step)
        block = words[r0 * COLS: r1 * COLS].view(r1 - r0, COLS)
        row_sums(block, tables, sums[r0:r1])
    if nrows > full_rows:
        last = words[full_rows * COLS:]
        if tail:
            pad = torch.zeros(4, dtype=torch.uint8, device=device)
            pad[:tail] = buf[nw * 4:]
            last = torch.cat([last, pad.view(torch.int32)])
        k = last.numel()
        sums[full_rows, 0] = (last * cols[0, :k]).sum()
        sums[full_rows, 1] = (_rot(last) * cols[1, :k]).sum()
    rows = tables.rows_upto(max(nrows, 1))[: sums.shape[0]]
    combined = sums[:, 0] + sums[:, 1] * (1 << 32)
    return (combined * rows).sum() + _signed(n * LENGTH_MIX)


def _signed(v: int) -> int:
    v &= MASK
    return v - (1 << 64) if v >> 63 else v


def as_int(value: int | torch.Tensor) -> int:
    """A digest as an unsigned 64-bit Python int (reads a device value: synchronizes)."""
    if isinstance(value, torch.Tensor):
        value = int(value.item())
    return value & MASK


def as_ints(values: list[int | torch.Tensor]) -> list[int]:
    """Digests as unsigned 64-bit Python ints, the device values among them read in one copy to
    the host (one synchronization for all, not one per value)."""
    on_device = [v.reshape(()) for v in values if isinstance(v, torch.Tensor)]
    read = iter(torch.stack(on_device).cpu().tolist() if on_device else ())
    return [(next(read) if isinstance(v, torch.Tensor) else v) & MASK for v in values]


def compute(kind: str, buf: torch.Tensor) -> int | torch.Tensor:
    """The digest of ``buf`` in ``kind``; a torch digest stays a device value."""
    if kind == "xxh3":
        return xxh3(buf)
    if kind == "torch":
        return torch_digest(buf)
    raise ValueError(f"unknown digest kind {kind!r}")


def verify(kind: str, bucket_index: int, buf: torch.Tensor, expected: int, version: int) -> None:
    """Raise ChecksumError if ``buf`` does not digest to what the sender wrote."""
    got = as_int(compute(kind, buf))
    if got != expected & MASK:
        raise _mismatch(kind, bucket_index, version, got, expected & MASK)


def _mismatch(kind: str, bucket_index: int, version: int, got: int, expected: int) -> ChecksumError:
    return ChecksumError(f"bucket {bucket_index} of version {version} is corrupted: {kind} digest {got:016x}, "
                         f"sender wrote {expected:016x}")


def _host_now(value: Any) -> Any:
    """A digest computed on the host is read now (no wait); a device one stays for later."""
    return as_int(value) if isinstance(value, torch.Tensor) and value.device.type == "cpu" else value


class Checks:
    """A receiver's digest checks of one version, bucket by bucket in plan order.

    A bucket in host memory is checked at once, before it is loaded. A bucket in device memory
    is digested on the current stream, behind the copy that filled it and ahead of the loads
    out of it, and compared when the version is complete (:meth:`finish`): one read of every
    bucket's value instead of a host wait per bucket, so the host keeps queueing the next
    bucket's loads while the device digests. A bad bucket still fails the version with the
    same ChecksumError before it is committed (before the post-load hook); what was loaded of
    it is rolled back as any failure after the first load is."""

    def __init__(self, version: int):
        self.version = version
        # per bucket: (index, kind, its digest here or None where settled, the sender's)
        self._seen: list[tuple[int, str, Any, Any]] = []

    def add(self, kind: str, b: int, expected: int | torch.Tensor, buf: torch.Tensor | None = None) -> None:
        """Bucket ``b`` with the sender's ``kind`` digest ``expected`` (an int, or a device value
        read at the end); ``buf``: its bytes, to digest here (None: a peer on the node did)."""
        got = None if buf is None else _host_now(compute(kind, buf))
        expected = _host_now(expected)
        if not isinstance(got, torch.Tensor) and not isinstance(expected, torch.Tensor):
            if got is not None and got != expected & MASK:
                raise _mismatch(kind, b, self.version, got, expected & MASK)
            got = None  # settled here
        self._seen.append((b, kind, got, expected))

    def finish(self) -> list[int]:
        """Compare what was deferred (one host read for all of it); the sender's digests of every
        bucket added, in order, as unsigned ints.

        Raises:
            ChecksumError: the first bucket, in plan order, whose bytes differ from the sender's.
        """
        values = iter(as_ints([v for _, _, got, exp in self._seen for v in (got, exp) if v is not None]))
        out = []
        for b, kind, got, exp in self._seen:
            got = next(values) if got is not None else None
            exp = next(values)
            if got is not None and got != exp:
                raise _mismatch(kind, b, self.version, got, exp)
            out.append(exp)
        return out


def version_digest(kind: str | None, bucket_digests: Sequence[int] | Iterable[int]) -> str | None:
    """One value for a whole version, from its bucket digests in plan order: equal on the
    sender and on every receiver that holds the same version. None without digests."""
    if kind is None:
        return None
    values = [as_int(d) for d in bucket_digests]
    h = xxhash.xxh3_64(kind.encode())
    h.update(np.asarray(values, dtype=np.uint64).tobytes())
    return f"{kind}:{h.hexdigest()}"

