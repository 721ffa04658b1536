"""The one-pass digest kernel (weightsync/digest/kernel.py) gives the torch ops way's value bit for
bit: on CPU under Triton's interpreter (TRITON_INTERPRET=1: the kernel's own code, run by
numpy), and on a GPU where one is lent (-m cuda)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from weightsync import digest as D
from weightsync.digest import kernel
from weightsync.manifest import DTYPES

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="Triton is not installed (the dev extra installs it)")

WORD = 4
ROW = 4 * D.COLS  # bytes of one row of the definition


@pytest.fixture
def interpreted(monkeypatch):
    """The kernel on CPU tensors through Triton's interpreter (decorated anew, and again after)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv(kernel.ENV, "on")
    kernel._triton.cache_clear()
    assert kernel.enabled(torch.device("cpu"))
    yield
    kernel._triton.cache_clear()


def _torch_way(buf: torch.Tensor, monkeypatch) -> int:
    with monkeypatch.context() as m:
        m.setenv(kernel.ENV, "off")
        return D.as_int(D.torch_digest(buf))


def _random(nbytes: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


# 1-word and shorter buckets, every tail length, a row and around it, several rows with a tail
SIZES = [0, 1, 2, 3, WORD, WORD + 1, 7, 1000, ROW - 1, ROW, ROW + 2, 3 * ROW + 3, 9 * ROW + 1]


@pytest.mark.parametrize("nbytes", SIZES)
def test_kernel_gives_the_torch_digest_of_random_buckets(interpreted, monkeypatch, nbytes):
    buf = _random(nbytes, nbytes)
    assert D.as_int(D.torch_digest(buf)) == _torch_way(buf, monkeypatch)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_kernel_gives_the_torch_digest_of_every_dtypes_bytes(interpreted, monkeypatch, dtype):
    """Each dtype's bytes as a bucket holds them: special values (NaN, -0.0, inf) and an odd
    element count, so most end in a tail."""
    t = DTYPES[dtype]
    n = 1001
    if t.is_floating_point:
        vals = torch.randn(n, generator=torch.Generator().manual_seed(3)) * 1e3
        vals[:4] = torch.tensor([float("nan"), -0.0, float("inf"), -float("inf")])
        x = vals.to(t)
    elif t.is_complex:
        x = torch.randn(n, dtype=t, generator=torch.Generator().manual_seed(3))
    elif t == torch.bool:
        x = _random(n, 3) & 1 == 1
    else:
        x = _random(n * t.itemsize, 3).view(t)
    buf = x.reshape(-1).view(torch.uint8)
    assert D.as_int(D.torch_digest(buf)) == _torch_way(buf, monkeypatch)


def test_kernel_digests_an_odd_start_as_the_torch_way_does(interpreted, monkeypatch):
    buf = _random(2 * ROW + 9, 11)[1:]  # words copied first: the kernel reads the tail from the original
    assert D.as_int(D.torch_digest(buf)) == _torch_way(buf, monkeypatch)


def test_kernel_sees_a_single_flipped_bit_in_the_tail(interpreted):
    buf = _random(ROW + 3, 5)
    before = D.as_int(D.torch_digest(buf))
    buf[-1] ^= 0x80
    assert D.as_int(D.torch_digest(buf)) != before


@pytest.mark.parametrize("tile", ["1024x1", "1024x4", "2048x2"])
def test_any_tile_gives_the_same_value(interpreted, monkeypatch, tile):
    """The tile is a tuning knob (WEIGHTSYNC_DIGEST_KERNEL=<block>x<rows>), never a change of value."""
    buf = _random(3 * ROW + 6, 13)
    monkeypatch.setenv(kernel.ENV, tile)
    assert D.as_int(D.torch_digest(buf)) == _torch_way(buf, monkeypatch)


def test_the_kernel_stays_off_on_a_cpu_unless_asked(monkeypatch):
    monkeypatch.delenv(kernel.ENV, raising=False)
    assert not kernel.enabled(torch.device("cpu"))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("nbytes", [1, 7, ROW + 2, 9 * ROW + 1, (256 << 20) + 6])
def test_kernel_on_cuda_gives_the_torch_digest(monkeypatch, nbytes):
    monkeypatch.delenv(kernel.ENV, raising=False)
    buf = _random(nbytes, nbytes).cuda()
    assert kernel.enabled(buf.device)
    assert D.as_int(D.torch_digest(buf)) == _torch_way(buf, monkeypatch) == D.as_int(D.torch_digest(buf.cpu()))
