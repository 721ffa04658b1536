"""Bucket plan, pack and unpack: pure functions, checked exhaustively and by property tests."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.parties import same_bits
from weightsync_bench.layouts import layout, materialize

from weightsync import ManifestError
from weightsync.digest import xxh3 as checksum
from weightsync.manifest import (
    DTYPES,
    Manifest,
    Packer,
    TensorSpec,
    Unpacker,
    build_manifest,
    check_manifest,
    gaps,
    pack,
    plan_buckets,
    size_text,
)


def random_tensor(dtype: torch.dtype, shape, seed: int) -> torch.Tensor:
    n = 1
    for d in shape:
        n *= d
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        raw &= 1  # a bool byte other than 0/1 is not a valid bool; torch may normalise it
    return raw.view(dtype).view(shape)


def roundtrip(named: dict, bucket_bytes: int, align: int = 256) -> dict:
    manifest = build_manifest(named)
    plan = plan_buckets(manifest, bucket_bytes, align)
    buffers = [torch.full((bucket_bytes,), 0xAB, dtype=torch.uint8) for _ in plan.buckets]
    pack(plan, manifest, named, buffers)
    out = {}
    unpacker = Unpacker(plan, manifest)
    for b in range(plan.bucket_count):
        for name, t in unpacker.unpack(b, buffers[b]):
            assert name not in out
            out[name] = t.clone()
    return out


@pytest.mark.parametrize("dtype_name", sorted(DTYPES))
def test_every_dtype_roundtrips_bit_exact(dtype_name):
    dtype = DTYPES[dtype_name]
    named = {
        "whole": random_tensor(dtype, (7, 5), 1),
        "split": random_tensor(dtype, (300,), 2),  # larger than the 1 KiB bucket below
        "empty": torch.empty((0, 3), dtype=dtype),
        "scalar": random_tensor(dtype, (), 3),
        "strided": random_tensor(dtype, (6, 9), 4).t(),
    }
    assert not named["strided"].is_contiguous()
    out = roundtrip(named, 1024)
    assert set(out) == set(named)
    for name, t in named.items():
        assert same_bits(out[name], t), name


@st.composite
def layouts(draw):
    count = draw(st.integers(1, 12))
    names = [f"t{i}" for i in range(count)]
    dtypes = draw(st.lists(st.sampled_from(sorted(DTYPES)), min_size=count, max_size=count))
    shapes = draw(st.lists(st.lists(st.integers(0, 40), min_size=0, max_size=3), min_size=count, max_size=count))
    align = draw(st.sampled_from([16, 64, 256]))
    bucket_bytes = align * draw(st.integers(1, 24))
    return [TensorSpec(n, d, tuple(s)) for n, d, s in zip(names, dtypes, shapes)], bucket_bytes, align


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layouts())
def test_plan_invariants(case):
    specs, bucket_bytes, align = case
    manifest = Manifest(tuple(specs))
    plan = plan_buckets(manifest, bucket_bytes, align)
    assert plan == plan_buckets(manifest, bucket_bytes, align), "deterministic"
    for i, spec in enumerate(manifest):
        pieces = plan.tensor_slices[i]
        assert sum(p.nbytes for p in pieces) == spec.nbytes
        start = 0
        for p in pieces:
            assert p.start == start and p.tensor == i
            assert p.offset % align == 0 or p.start > 0 or p.nbytes == 0
            assert p.nbytes % spec.itemsize == 0 or p is pieces[-1]
            start += p.nbytes
        if spec.nbytes <= bucket_bytes:
            assert len(pieces) == 1, "a tensor that fits a bucket is never split"
    for b in plan.buckets:
        spans = sorted((s.offset, s.offset + s.nbytes) for s in b.slices if s.nbytes)
        for (_, end), (start, _) in zip(spans, spans[1:]):
            assert end <= start, "no overlap inside a bucket"
        assert all(end <= bucket_bytes for _, end in spans)
        assert b.nbytes <= bucket_bytes


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layouts(), st.integers(0, 2**31))
def test_pack_unpack_roundtrip_property(case, seed):
    specs, bucket_bytes, align = case
    named = {s.name: random_tensor(s.torch_dtype, s.shape, seed + i) for i, s in enumerate(specs)}
    out = roundtrip(named, bucket_bytes, align)
    for name, t in named.items():
        assert same_bits(out[name], t), name


def _pack(named_iter, manifest, bucket_bytes=4096):
    plan = plan_buckets(manifest, bucket_bytes, 256)
    return pack(plan, manifest, named_iter, [torch.empty(bucket_bytes, dtype=torch.uint8) for _ in plan.buckets])


BASE = {"a": torch.ones(4, 4), "b": torch.zeros(8, dtype=torch.int32), "c": torch.ones(3, dtype=torch.bfloat16)}


@pytest.mark.parametrize(
    "offered,pattern",
    [
        ([("a", BASE["a"]), ("b", BASE["b"]), ("zzz", BASE["c"])], "unknown tensor 'zzz'"),
        ([("a", BASE["a"]), ("b", BASE["b"])], "missing tensor.*'c'"),
        ([("a", torch.ones(4, 5)), ("b", BASE["b"]), ("c", BASE["c"])], r"'a' has shape \[4, 5\]"),
        ([("a", BASE["a"]), ("b", BASE["b"].float()), ("c", BASE["c"])], "'b' has dtype float32"),
        ([("a", BASE["a"]), ("a", BASE["a"]), ("c", BASE["c"])], "duplicate tensor name 'a'"),
        ([("b", BASE["b"]), ("a", BASE["a"]), ("c", BASE["c"])], "'b' is out of order"),
    ],
)
def test_packing_rejects_bad_input_naming_the_tensor(offered, pattern):
    manifest = build_manifest(BASE)
    with pytest.raises(ManifestError, match=pattern):
        _pack(iter(offered), manifest)
    with pytest.raises(ManifestError, match=pattern.replace("duplicate tensor name", "duplicate|out of order|missing")):
        _pack(iter(offered), manifest)


def test_mapping_input_is_checked_whole_before_any_byte_is_written():
    manifest = build_manifest(BASE)
    plan = plan_buckets(manifest, 4096, 256)
    bad = {"a": BASE["a"], "b": BASE["b"], "c": torch.ones(4, dtype=torch.bfloat16)}
    with pytest.raises(ManifestError, match="'c' has shape"):
        Packer(plan, manifest, bad)  # before any bucket is asked for


def test_dtensor_like_input_is_refused_with_advice():
    class FakeDTensor:
        shape, dtype, placements = (2,), torch.float32, ("Shard(0)",)

        def full_tensor(self):
            return torch.ones(2)

    with pytest.raises(ManifestError, match="DTensor.*full_tensor"):
        build_manifest({"w": FakeDTensor()})


def test_check_manifest_names_each_problem():
    manifest = build_manifest(BASE)
    model = {"a": torch.ones(4, 4), "b": torch.zeros(9, dtype=torch.int32), "c": torch.ones(3), "d": torch.ones(1)}
    with pytest.raises(ManifestError) as err:
        check_manifest(manifest, model)
    text = str(err.value)
    assert "'b' has shape [8]" in text and "'c' has dtype bfloat16" in text and "missing tensor(s) 'd'" in text
    with pytest.raises(ManifestError, match="unknown tensor 'c'"):
        check_manifest(manifest, {"a": torch.ones(4, 4), "b": torch.zeros(8, dtype=torch.int32)})
    check_manifest(manifest, {**model, "b": BASE["b"], "c": BASE["c"]}, strict=False)  # extra 'd' tolerated


def test_checksum_sees_a_single_flipped_bit():
    buf = torch.zeros(1 << 16, dtype=torch.uint8)
    before = checksum(buf)
    buf[12345] ^= 1
    assert checksum(buf) != before


@pytest.mark.parametrize("bucket_bytes", [1 << 20, 3 << 20])
def test_checksums_computed_while_packing_equal_a_hash_of_the_packed_bucket(bucket_bytes):
    from weightsync.manifest import CHUNK

    named = {
        "tiny": random_tensor(torch.float32, (3,), 1),
        "chunks": random_tensor(torch.bfloat16, (CHUNK * 3 // 2 + 7,), 2),  # several copy pieces
        "split": random_tensor(torch.uint8, (bucket_bytes + CHUNK + 5,), 3),  # spans buckets
        "strided": random_tensor(torch.float16, (300, 40), 4).t(),
        "strided_split": random_tensor(torch.float32, (1024, 400), 5).t(),  # split and not contiguous
        "empty": torch.empty((0,), dtype=torch.int64),
        "last": random_tensor(torch.int8, (9,), 6),
    }
    manifest = build_manifest(named)
    plan = plan_buckets(manifest, bucket_bytes, 256)
    # stale bytes in the alignment gaps are part of what a receiver hashes: they must count
    buffers = {b: torch.full((bucket_bytes,), 0x5A, dtype=torch.uint8) for b in range(plan.bucket_count)}
    packer = Packer(plan, manifest, named)
    for b in range(plan.bucket_count):
        # the digest fill() returns is final: a transport publishes bucket b right after
        assert packer.fill(b, buffers[b], "xxh3") == checksum(buffers[b][: plan.buckets[b].nbytes]), f"bucket {b}"
    with pytest.raises(ValueError, match="out of order"):
        packer.fill(0, buffers[0], "xxh3")
    unpacker = Unpacker(plan, manifest)
    out = {n: t.clone() for b in range(plan.bucket_count) for n, t in unpacker.unpack(b, buffers[b])}
    assert all(same_bits(out[n], t) for n, t in named.items())


def test_manifest_wire_roundtrip_and_digest():
    manifest = build_manifest(BASE)
    again = Manifest.from_wire(manifest.to_wire())
    assert again == manifest and again.digest() == manifest.digest()
    other = build_manifest({**BASE, "c": torch.ones(4, dtype=torch.bfloat16)})
    assert other.digest() != manifest.digest()
    with pytest.raises(ManifestError):
        Manifest.from_wire([["x", "not_a_dtype", [1]]])


@pytest.mark.parametrize("contiguous", [True, False])
def test_split_tensors_come_back_as_views_where_storage_is_contiguous(contiguous):
    named = {"small": random_tensor(torch.float32, (10,), 1), "big": random_tensor(torch.bfloat16, (5000,), 2),
             "tail": random_tensor(torch.int8, (7,), 3)}
    manifest = build_manifest(named)
    plan = plan_buckets(manifest, 1024, 256)
    stride = 1024 if contiguous else 1024 + 256  # buckets back to back, or with gaps between them
    storage = torch.zeros(plan.bucket_count * stride, dtype=torch.uint8)
    pack(plan, manifest, named, [storage[b * stride:b * stride + 1024] for b in range(plan.bucket_count)])

    def span(bucket, offset, nbytes):
        if offset + nbytes > 1024 and not contiguous:
            return None  # crosses into the next bucket across a gap
        return storage[bucket * stride + offset: bucket * stride + offset + nbytes]

    out, unpacker = {}, Unpacker(plan, manifest)
    for b in range(plan.bucket_count):
        for name, t in unpacker.unpack(b, storage[b * stride:b * stride + 1024], span):
            out[name] = t
    assert all(same_bits(out[n], named[n]) for n in named)
    shares = out["big"].untyped_storage().data_ptr() == storage.untyped_storage().data_ptr()
    assert shares == contiguous, "a view of the storage, no copy, exactly when it is contiguous"


def test_split_tensors_are_rebuilt_in_two_arenas_not_one_buffer_each():
    # five split tensors of different sizes; each bucket's pairs are copied out before the next
    # bucket is unpacked, as the receiver's load_weights does: bit-exact over two versions, and
    # the unpacker holds the largest split tensor of each parity, not the sum of all five
    sizes = {"a": 3000, "b": 900, "c": 2600, "d": 700, "e": 1800}  # bf16 elements, 1 KiB buckets
    manifest = build_manifest({n: torch.zeros(k, dtype=torch.bfloat16) for n, k in sizes.items()})
    plan = plan_buckets(manifest, 1024, 256)
    assert all(len(p) > 1 for p in plan.tensor_slices), "every tensor is split"
    unpacker = Unpacker(plan, manifest)
    for version in (1, 2):
        named = {n: random_tensor(torch.bfloat16, (k,), version * 10 + i) for i, (n, k) in enumerate(sizes.items())}
        storage = torch.zeros(plan.bucket_count * 1024, dtype=torch.uint8)
        pack(plan, manifest, named, [storage[b * 1024:(b + 1) * 1024] for b in range(plan.bucket_count)])
        out = {}
        for b in range(plan.bucket_count):
            out.update({n: t.clone() for n, t in unpacker.unpack(b, storage[b * 1024:(b + 1) * 1024])})
        assert all(same_bits(out[n], named[n]) for n in named), version
    assert unpacker.assembly_bytes() == 2 * 3000 + 2 * 900, "a, c, e share one arena; b, d the other"


def test_a_bucket_digest_ignores_what_a_recycled_buffer_held_in_its_padding():
    """Packed into a buffer full of another bucket's bytes or into zeroed memory, a bucket
    hashes the same: the packer zeroes the alignment gaps (a version's digest depends on its
    weights only, whichever transport, mode or buffer carried it)."""
    manifest = layout("tiny")
    plan = plan_buckets(manifest, 1 << 16, 256)
    assert any(gaps(b) for b in plan.buckets), "the layout must have padding for this test to mean anything"
    tensors = materialize(manifest, seed=3)
    digests = []
    for fill in (0, 0xA5):
        bufs = [torch.full((1 << 16,), fill, dtype=torch.uint8) for _ in plan.buckets]
        digests.append(pack(plan, manifest, tensors, bufs, "xxh3"))
    assert digests[0] == digests[1]


@pytest.mark.parametrize("nbytes,text", [
    (0, "0 B"), (999, "999 B"), (1000, "0.977 KiB"), (406528, "397 KiB"), (1023 << 20, "0.999 GiB"),
    (16 << 20, "16 MiB"), (1256277934, "1.17 GiB"), (10 << 40, "10 TiB"), (2000 << 40, "2000 TiB"),
])
def test_sizes_read_in_three_digits_and_never_in_exponents(nbytes, text):
    assert size_text(nbytes) == text
