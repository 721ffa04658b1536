"""Micro-benchmarks of the hot pure functions (plan, pack, unpack, checksum).

Not part of the default test run (pytest's testpaths is tests/). Run them with
    pytest benchmarks/ --benchmark-only
and compare runs with --benchmark-autosave / --benchmark-compare.
"""

from __future__ import annotations

import pytest
import torch
from weightsync_bench.layouts import layout, materialize

from weightsync.digest import xxh3 as checksum
from weightsync.manifest import Manifest, TensorSpec, Unpacker, pack, plan_buckets

pytest.importorskip("pytest_benchmark")

MiB = 1 << 20
# 64 MiB in 256 tensors of 256 KiB plus a 16 MiB one that is split across buckets
MANIFEST = Manifest(tuple([TensorSpec(f"t{i}", "bfloat16", (512, 256)) for i in range(256)]
                          + [TensorSpec("big", "bfloat16", (8 * MiB,))]))
BUCKET = 8 * MiB


@pytest.fixture(scope="module")
def plan():
    return plan_buckets(MANIFEST, BUCKET)


@pytest.fixture(scope="module")
def tensors():
    return materialize(MANIFEST, seed=1)


@pytest.fixture(scope="module")
def buckets(plan):
    return [torch.empty(b.nbytes, dtype=torch.uint8) for b in plan.buckets]


@pytest.mark.parametrize("name", ["qwen2.5-0.5b", "moe-small"])
def test_plan_buckets(benchmark, name):
    m = layout(name)
    p = benchmark(plan_buckets, m, 64 * MiB)
    assert p.payload_bytes == m.total_bytes


def test_pack(benchmark, plan, tensors, buckets):
    done = benchmark(lambda: pack(plan, MANIFEST, tensors, buckets))
    assert len(done) == plan.bucket_count
    benchmark.extra_info["GB/s"] = MANIFEST.total_bytes / benchmark.stats.stats.median / 1e9


def test_unpack(benchmark, plan, tensors, buckets):
    pack(plan, MANIFEST, tensors, buckets)
    unpacker = Unpacker(plan, MANIFEST)

    def unpack():
        return sum(len(unpacker.unpack(b, buf)) for b, buf in enumerate(buckets))

    assert benchmark(unpack) == len(MANIFEST)


def test_checksum(benchmark, buckets):
    buf = buckets[0]
    buf.fill_(3)
    digest = benchmark(checksum, buf)
    assert digest == checksum(buf.clone())
    benchmark.extra_info["GB/s"] = buf.numel() / benchmark.stats.stats.median / 1e9


def test_pack_transposed_split(benchmark):
    """A transposed 64 MiB matrix split over eight buckets: flattened once, not per bucket."""
    weight = torch.randn(4096, 4096).t()
    manifest = Manifest((TensorSpec("w", "float32", tuple(weight.shape)),))
    p = plan_buckets(manifest, BUCKET)
    out = [torch.empty(b.nbytes, dtype=torch.uint8) for b in p.buckets]
    done = benchmark(lambda: pack(p, manifest, {"w": weight}, out, "xxh3"))
    assert len(done) == p.bucket_count == 8
    assert torch.equal(torch.cat(out).view(torch.float32).view(weight.shape), weight)
    benchmark.extra_info["GB/s"] = manifest.total_bytes / benchmark.stats.stats.median / 1e9


@pytest.mark.parametrize("kind", ["xxh3", "torch"])
def test_bucket_digest(benchmark, kind):
    """One 16 MiB bucket (the default) of random bytes, each digest kind (docs/digest.md)."""
    from weightsync import digest

    buf = torch.randint(0, 256, (16 * MiB,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    value = benchmark(lambda: digest.as_int(digest.compute(kind, buf)))
    assert value == digest.as_int(digest.compute(kind, buf.clone()))
    benchmark.extra_info["GB/s"] = buf.numel() / benchmark.stats.stats.median / 1e9
