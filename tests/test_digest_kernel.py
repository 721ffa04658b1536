"""The one-pass digest kernel (weightsync/digest/kernel.py) gives the torch ops way's value bit for
bit: on CPU under Triton's interpreter (the kernel's own code, run by numpy), and on a GPU where
one is lent (-m cuda).

The interpreter runs in a process of its own: Triton decides at import whether its library
functions (``tl.sum`` and the like) are interpreted, so a suite in which torch imported Triton
first could not interpret the kernel."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from weightsync import digest as D
from weightsync.digest import kernel
from weightsync.manifest import DTYPES

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="Triton is not installed (the dev extra installs it)")

WORD = 4
ROW = 4 * D.COLS  # bytes of one row of the definition
# 1-word and shorter buckets, every tail length, a row and around it, several rows with a tail
SIZES = [0, 1, 2, 3, WORD, WORD + 1, 7, 1000, ROW - 1, ROW, ROW + 2, 3 * ROW + 3, 9 * ROW + 1]
TILES = ["1024x1", "1024x4", "2048x2"]


def _random(nbytes: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def _dtype_bytes(name: str) -> torch.Tensor:
    """A dtype's bytes as a bucket holds them: special values (NaN, -0.0, inf) and an odd element
    count, so most end in a tail."""
    t, n = DTYPES[name], 1001
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
    return x.reshape(-1).view(torch.uint8)


@functools.cache
def cases() -> dict[str, tuple[torch.Tensor, str | None]]:
    """Every bucket digested here, by name: (its bytes, the tile to use or None: the default)."""
    out: dict[str, tuple[torch.Tensor, str | None]] = {f"size-{n}": (_random(n, n), None) for n in SIZES}
    out.update({f"dtype-{name}": (_dtype_bytes(name), None) for name in sorted(DTYPES)})
    # an odd start: the words are copied first, the tail is read from the original
    out["odd-start"] = (_random(2 * ROW + 9, 11)[1:], None)
    flipped = _random(ROW + 3, 5)
    out["tail-before"] = (flipped.clone(), None)
    flipped[-1] ^= 0x80
    out["tail-after"] = (flipped, None)
    out.update({f"tile-{tile}": (_random(3 * ROW + 6, 13), tile) for tile in TILES})
    return out


def _interpreted() -> None:
    """In the child: each case's digest by the kernel, as JSON on stdout."""
    values = {}
    for name, (buf, tile) in cases().items():
        os.environ[kernel.ENV] = tile or "on"
        assert kernel.enabled(buf.device)
        values[name] = D.as_int(D.torch_digest(buf))
    print(json.dumps(values))


@pytest.fixture(scope="module")
def by_kernel() -> dict[str, int]:
    env = {**os.environ, "TRITON_INTERPRET": "1", kernel.ENV: "on"}
    here = Path(__file__).resolve().parent
    done = subprocess.run([sys.executable, "-c", "import test_digest_kernel as t; t._interpreted()"], cwd=here,
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _torch_way(buf: torch.Tensor, monkeypatch) -> int:
    with monkeypatch.context() as m:
        m.setenv(kernel.ENV, "off")
        return D.as_int(D.torch_digest(buf))


@pytest.mark.parametrize("name", list(cases()))
def test_kernel_gives_the_torch_digest(by_kernel, monkeypatch, name):
    """Random buckets of every size class, every dtype's bytes, an odd start, every tile."""
    assert by_kernel[name] == _torch_way(cases()[name][0], monkeypatch)


def test_kernel_sees_a_single_flipped_bit_in_the_tail(by_kernel):
    assert by_kernel["tail-before"] != by_kernel["tail-after"]


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


def _compile_for_cuda(buf: torch.Tensor) -> None:
    """Compile (to Triton's IR, no device needed) the kernel launch digest() makes for ``buf``,
    specialized for an H100 the way Triton's launcher specializes it: an integer argument equal
    to 1 becomes a compile-time constant there, which the interpreter never does."""
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = kernel._triton()
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    _, args, constants = kernel.launch(D._words(buf), buf, buf.numel(), D._tables_for(buf.device),
                                       D._signed(buf.numel() * D.LENGTH_MIX), D.COLS)
    bound, specialization, options = create_function_from_signature(fn.signature, fn.params, backend)(
        *args, **constants, debug=False)
    options, signature, constexprs, attrs = fn._pack_args(backend, constants, bound, specialization, options)
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    ASTSource(fn, signature, constexprs, attrs).make_ir(
        target, options, backend.get_codegen_implementation(options), backend.get_module_map(), context)


@pytest.mark.parametrize("nbytes", [1, WORD, WORD + 3, 2 * WORD, ROW + 2])
def test_the_kernel_compiles_for_a_cuda_target_at_every_size(nbytes):
    """A bucket of 4-7 bytes has one whole word: Triton made that count a constant, and the
    kernel failed to compile on an H100 (the interpreter above cannot see it)."""
    try:
        from triton.compiler import make_backend  # noqa: F401
        from triton.runtime.jit import create_function_from_signature  # noqa: F401
    except ImportError as e:  # Triton's internals moved: the GPU tier (-m cuda) still covers it
        pytest.skip(f"this Triton has no {e.name}: cannot compile for a CUDA target without one")
    _compile_for_cuda(_random(nbytes, nbytes))
