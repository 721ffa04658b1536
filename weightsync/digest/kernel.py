"""Internal. The torch digest (weightsync/digest/__init__.py) in one pass: a Triton kernel that reads
each 4-byte word of a bucket once and forms both lanes and the row sums in registers.

The torch ops way makes about six passes over a bucket and launches about forty kernels per
256 MiB (lanes into scratch buffers, then their sums): 11.7x one device copy of the same bytes
on an H100. Here each program takes a tile of a few rows by one block of columns: the column
weights are loaded once per tile and applied to each of its rows, so the bytes are read once
and the tables come from cache. Because the definition is a position-
weighted sum, any split of the rows and columns gives the same value: each program writes
``sum over its rows of R[r] * (s_1 + 2**32 * s_2)`` (mod 2**64) for its columns, and one
``sum`` of those partials (the length term in a slot of its own) is the digest, bit for bit
the torch way's (tests/test_digest_kernel.py, on CPU under Triton's interpreter).

Used on CUDA wherever Triton imports; the torch ops way stays for NPU, other registered devices and
machines without Triton. ``WEIGHTSYNC_DIGEST_KERNEL=off`` turns it off (to compare the ways).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Any

import torch

ENV = "WEIGHTSYNC_DIGEST_KERNEL"
# the tile of words one program digests, columns x rows: a 256 MiB bucket (1024 rows of 64 Ki
# words) makes 32 x 512 programs, many per SM of an H100; each reads 16 KiB of data against 16
# KiB of column weights (from L2). On one H100 this tile digested 1.17 GiB in 0.62 ms, 0.69x one
# device copy of the bytes; 1024x4 took 0.85 ms, 512x8, 2048x4 and 4096x1 0.63-0.65 ms
# (benchmarks/digest_device.py, docs/digest.md). WEIGHTSYNC_DIGEST_KERNEL=<block>x<rows> tries another
BLOCK, ROWS = 2048, 2


@functools.cache
def _triton() -> Any:
    """The kernel, or None where Triton cannot run it."""
    if importlib.util.find_spec("triton") is None:
        return None
    try:
        import triton
        import triton.language as tl
    except Exception:  # an install whose compiler or driver parts are missing
        return None

    # Triton makes an integer argument equal to 1 a compile-time constant (a bucket of 4-7 bytes
    # has nw == 1), which has no .to(): these stay runtime values, one compiled kernel for all
    @triton.jit(do_not_specialize=["nw", "tail", "nrows", "length_term"])
    def digest_kernel(words, raw, cols1, cols2, row_weights, out, nw, tail, nrows, length_term,
                      COLS: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr):
        pc, pr = tl.program_id(0), tl.program_id(1)
        c = pc * BLOCK + tl.arange(0, BLOCK)
        r = pr * ROWS + tl.arange(0, ROWS)
        a1 = tl.load(cols1 + c).to(tl.uint32, bitcast=True)
        a2 = tl.load(cols2 + c).to(tl.uint32, bitcast=True)
        # the last 1-3 bytes, zero-padded to a word (little-endian), at word index nw
        k = tl.arange(0, 4)
        tb = tl.load(raw + nw.to(tl.int64) * 4 + k, mask=k < tail, other=0).to(tl.uint32)
        tail_word = tl.sum(tb << (k.to(tl.uint32) * 8), axis=0)
        offs = r.to(tl.int64)[:, None] * COLS + c[None, :]
        x = tl.load(words + offs, mask=offs < nw, other=0).to(tl.uint32, bitcast=True)
        x = tl.where(offs == nw, tail_word, x)
        rot = (x << 16) | (x >> 16)
        # products mod 2**32 read as signed int32, summed exactly in int64 per row
        s1 = tl.sum((x * a1[None, :]).to(tl.int32, bitcast=True).to(tl.int64), axis=1)
        s2 = tl.sum((rot * a2[None, :]).to(tl.int32, bitcast=True).to(tl.int64), axis=1)
        w = tl.load(row_weights + r, mask=r < nrows, other=0)
        total = tl.sum(w * (s1 + (s2 << 32)), axis=0)  # wraps mod 2**64, as the definition does
        total += tl.where((pc == 0) & (pr == 0), length_term, 0)
        tl.store(out + pr * tl.num_programs(0) + pc, total)

    return digest_kernel


def _shape() -> tuple[int, int]:
    raw = os.environ.get("WEIGHTSYNC_DIGEST_KERNEL", "")
    if "x" in raw:
        block, rows = (int(x) for x in raw.split("x", 1))
        return block, rows
    return BLOCK, ROWS


def enabled(device: torch.device) -> bool:
    """Whether buckets on ``device`` are digested by the kernel: CUDA with Triton, unless turned
    off; anywhere with ``WEIGHTSYNC_DIGEST_KERNEL=on`` (the tests run it on CPU tensors under
    ``TRITON_INTERPRET=1``)."""
    setting = os.environ.get("WEIGHTSYNC_DIGEST_KERNEL", "auto")
    if setting == "off":
        return False
    if setting == "auto" and device.type != "cuda":
        return False
    return _triton() is not None


def launch(words: torch.Tensor, raw: torch.Tensor, n: int, tables: Any, length_term: int,
           cols: int) -> tuple[tuple[int, int], tuple[Any, ...], dict[str, int]]:
    """The grid, arguments and compile-time constants digest() launches the kernel with (the
    tests compile exactly these for a CUDA target on a machine without one)."""
    block, rows_per = _shape()
    nw = words.numel()
    tail = n - nw * 4
    padded = nw + (1 if tail else 0)
    nrows = max(1, -(-padded // cols))
    col_blocks = min(cols // block, max(1, -(-padded // block)))
    row_groups = -(-nrows // rows_per)
    out = torch.empty(col_blocks * row_groups, dtype=torch.int64, device=words.device)
    args = (words, raw, tables.cols[0], tables.cols[1], tables.rows_upto(nrows), out, nw, tail, nrows, length_term)
    return (col_blocks, row_groups), args, {"COLS": cols, "BLOCK": block, "ROWS": rows_per}


def digest(words: torch.Tensor, raw: torch.Tensor, n: int, tables: Any, length_term: int, cols: int) -> torch.Tensor:
    """The digest of a bucket of ``n`` bytes as a 0-dim int64 tensor on its device, no host
    synchronization. ``words``: its whole int32 words; ``raw``: its bytes (for the tail);
    ``tables``: the device's weight tables (digest._Tables); ``length_term``: n * LENGTH_MIX as
    a signed int64; ``cols``: words per row (digest.COLS)."""
    grid, args, constants = launch(words, raw, n, tables, length_term, cols)
    _triton()[grid](*args, **constants)
    return args[5].sum()  # the partials, one per program
