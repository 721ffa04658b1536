"""Bucket digests (weightsync/digest/__init__.py): the torch digest's definition and sensitivity, the
kind each transport uses, and end to end: a corrupted bucket is refused on shm, ipc and
gloo broadcast by the torch digest, and a version's digest is the same on every party."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import ray
import torch
from support.parties import TrainerWorker, assert_serves, same_bits
from weightsync_bench.layouts import layout, materialize

from weightsync import ConfigError, SyncConfig, SyncFailed
from weightsync import digest as D
from weightsync.manifest import pack, plan_buckets

TINY = layout("tiny")
BUCKET = 1 << 16  # 64 KiB: the tiny layout spans several buckets, one tensor split over some


def _reference(buf: torch.Tensor) -> int:
    """The torch digest written out in Python integers, from its definition in digest/__init__.py."""
    data = bytes(buf.numpy())
    n = len(data)
    words = [int(v) for v in np.frombuffer(data + b"\0" * (-n % 4), dtype=np.int32)]
    lanes = D._Tables(torch.device("cpu")).cols.numpy().astype(np.int64)
    nrows = max(1, -(-len(words) // D.COLS))
    row_w = [int(v) for v in D._splitmix(D._SEED_ROW, 0, nrows)]
    sums = [[0, 0] for _ in range(nrows)]
    for i, x in enumerate(words):
        r, c = divmod(i, D.COLS)
        u = x & 0xFFFFFFFF
        for k, y in enumerate((u, (u >> 16) | ((u & 0xFFFF) << 16))):
            v = (y * int(lanes[k, c])) & 0xFFFFFFFF
            sums[r][k] += v - (1 << 32) if v >> 31 else v
    total = n * D.LENGTH_MIX + sum(row_w[r] * (s1 + (s2 << 32)) for r, (s1, s2) in enumerate(sums))
    return total & D.MASK


# the host's row sums and the device's (one read of the bytes), both run here on CPU tensors:
# a device and the host must agree on every bucket
ROW_SUMS = pytest.mark.parametrize("row_sums", [D._row_sums_swap, D._row_sums_pairs, D._row_sums_flat],
                                   ids=["host-swap", "device-pairs", "device-flat"])


@ROW_SUMS
@pytest.mark.parametrize("nbytes", [0, 1, 3, 4, 6, 1000, 4 * D.COLS, 4 * D.COLS + 2, 2 * 4 * D.COLS + 7])
def test_torch_digest_matches_its_definition(nbytes, row_sums, monkeypatch):
    monkeypatch.setitem(D.ROW_SUMS, "cpu", row_sums)
    buf = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(nbytes))
    assert D.as_int(D.torch_digest(buf)) == _reference(buf)


@ROW_SUMS
def test_torch_digest_of_a_large_odd_bucket_is_the_same_either_way(row_sums, monkeypatch):
    buf = torch.randint(0, 256, (3 * (1 << 22) + 6,), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))
    want = D.as_int(D.torch_digest(buf[1:]))  # an odd start: the words are copied first
    monkeypatch.setitem(D.ROW_SUMS, "cpu", row_sums)
    monkeypatch.setitem(D.CHUNK_WORDS, "cpu", D.DEVICE_CHUNK_WORDS)  # a device's step
    assert D.as_int(D.torch_digest(buf[1:])) == want


def test_torch_digest_does_not_depend_on_the_chunking(monkeypatch):
    """Sender and receiver may digest in other steps (CPU and device chunk sizes differ)."""
    buf = torch.randint(0, 256, (8 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    values = set()
    for words in (D.COLS, 1 << 18, 1 << 23):
        monkeypatch.setitem(D.CHUNK_WORDS, "cpu", words)
        values.add(D.as_int(D.torch_digest(buf)))
    assert len(values) == 1


# -- sensitivity: what a transport can do wrong to a bucket -----------------------------------

def _bucket(version: int, b: int = 0) -> torch.Tensor:
    """Bucket ``b`` of the tiny layout's weights of ``version``, packed as a sender packs it."""
    plan = plan_buckets(TINY, BUCKET)
    bufs = [torch.zeros(bk.nbytes, dtype=torch.uint8) for bk in plan.buckets]
    pack(plan, TINY, materialize(TINY, seed=version), bufs)
    return bufs[b]


def _changed(kind: str, before: torch.Tensor, after: torch.Tensor) -> bool:
    assert not torch.equal(before, after), "the test must change the bytes"
    return D.as_int(D.compute(kind, before)) != D.as_int(D.compute(kind, after))


KINDS = pytest.mark.parametrize("kind", D.KINDS)


@KINDS
def test_every_single_flipped_bit_is_caught(kind):
    buf = _bucket(1)
    n = buf.numel()
    missed = []
    for byte in (0, 1, 2, 3, n // 2, n // 2 + 3, n - 5, n - 1):
        for bit in range(8):
            bad = buf.clone()
            bad[byte] ^= 1 << bit
            if not _changed(kind, buf, bad):
                missed.append((byte, bit))
    assert not missed


@KINDS
def test_swapped_8_byte_words_are_caught(kind):
    buf = _bucket(1)
    buf = buf[: buf.numel() // 8 * 8].clone()
    words = buf.view(torch.int64)
    missed = []
    for i, j in ((0, 1), (5, 900), (100, words.numel() - 1), (7, words.numel() // 2 + 3)):
        if words[i] == words[j]:
            continue
        bad = buf.clone()
        w = bad.view(torch.int64)
        w[i], w[j] = words[j].item(), words[i].item()
        if not _changed(kind, buf, bad):
            missed.append((i, j))
    assert not missed


@KINDS
def test_swapped_words_that_differ_only_in_their_sign_bits_are_caught(kind):
    """The worst case for a weighted sum that is linear over the data: 8-byte words whose
    two halves differ only in bit 31, once up and once down, so that plain differences cancel."""
    buf = torch.zeros(1 << 16, dtype=torch.uint8)
    halves = buf.view(torch.int32)
    halves[10], halves[11] = 5, -7                       # word 5: (5, -7)
    halves[2000], halves[2001] = 5 - 2**31, -7 + 2**31   # word 1000: both sign bits flipped
    bad = buf.clone()
    b = bad.view(torch.int64)
    b[5], b[1000] = buf.view(torch.int64)[1000].item(), buf.view(torch.int64)[5].item()
    assert _changed(kind, buf, bad)


@KINDS
def test_a_zeroed_tail_is_caught(kind):
    buf = _bucket(1)
    bad = buf.clone()
    bad[-1000:] = 0
    assert _changed(kind, buf, bad)


@KINDS
def test_a_stale_bucket_from_the_previous_version_is_caught(kind):
    plan = plan_buckets(TINY, BUCKET)
    missed = [b for b in range(plan.bucket_count) if not _changed(kind, _bucket(1, b), _bucket(2, b))]
    assert not missed


# -- packing and choosing the kind ------------------------------------------------------------

def test_packing_gives_the_torch_digest_of_each_packed_bucket():
    plan = plan_buckets(TINY, BUCKET)
    bufs = [torch.zeros(bk.nbytes, dtype=torch.uint8) for bk in plan.buckets]
    sums = pack(plan, TINY, materialize(TINY, seed=3), bufs, "torch")
    assert [D.as_int(v) for v in sums] == [D.as_int(D.torch_digest(bufs[b])) for b in range(plan.bucket_count)]


def test_batched_packing_writes_the_same_bytes_as_hashed_packing():
    """Without a streaming hash the copies go through one _foreach_copy_ per bucket."""
    plan = plan_buckets(TINY, BUCKET)
    out = []
    for kind in ("xxh3", None, "torch"):
        bufs = [torch.zeros(bk.nbytes, dtype=torch.uint8) for bk in plan.buckets]
        pack(plan, TINY, materialize(TINY, seed=4), bufs, kind)
        out.append(torch.cat(bufs))
    assert same_bits(out[0], out[1]) and same_bits(out[0], out[2])


@pytest.mark.parametrize("digest,checksum,device,want", [
    ("auto", True, "cpu", "xxh3"), ("auto", True, "cuda", "torch"), ("auto", True, "npu", "torch"),
    ("torch", True, "cpu", "torch"), ("xxh3", True, "cuda", "xxh3"), ("off", True, "cpu", None),
    ("auto", False, "cuda", None), ("torch", False, "cpu", None),
])
def test_kind_follows_where_the_buckets_live(digest, checksum, device, want):
    assert D.kind_of(SyncConfig(digest=digest, checksum=checksum), device) == want


def test_unknown_digest_kind_is_a_config_error():
    with pytest.raises(ConfigError, match="digest must be one of auto, xxh3, torch, off"):
        SyncConfig.from_mapping({"digest": "crc32"})


# -- end to end, real Ray actors --------------------------------------------------------------

class _CorruptingPacker:
    """A packer with one byte of bucket ``target`` flipped after it was filled and digested and
    before the transport publishes it: what a receiver sees after corruption in transit."""

    def __init__(self, packer, target: int):
        self.packer, self.target = packer, target

    def fill(self, b, dst, kind=None, views=None):
        value = self.packer.fill(b, dst, kind, views)
        if b == self.target:
            dst[3] ^= 0x40
        return value

    def __getattr__(self, name):
        return getattr(self.packer, name)


class CorruptingTrainer(TrainerWorker):
    """A trainer whose transport gets one corrupted bucket in the version named."""

    def corrupt_next(self, version: int, bucket: int) -> None:
        transport = self.sender.transport
        stage = transport.stage

        def corrupted_stage(v, slot, packer):
            return stage(v, slot, _CorruptingPacker(packer, bucket) if v == version else packer)

        transport.stage = corrupted_stage


ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _start(start_job, transport: str, digest: str, receivers: int):
    cfg = {"transport": transport, "bucket_mb": BUCKET / 2**20, "device": "cpu", "digest": digest}
    return start_job(cfg, receivers, TINY, trainer={"cls": CorruptingTrainer})


@pytest.mark.scenario("bad input", "bucket corrupted in transit (torch digest)")
@pytest.mark.parametrize("transport", ["shm", "ipc", "broadcast"])
def test_torch_digest_refuses_a_corrupted_bucket(start_job, transport):
    job = _start(start_job, transport, "torch", receivers=1)
    _, rs, trainer = job
    assert job.step(1)[0] == [1]
    ray.get(trainer.corrupt_next.remote(2, 0))
    applied = rs[0].apply.remote(2)
    with pytest.raises(SyncFailed) as err:
        ray.get(trainer.step.remote(2))
    with pytest.raises(Exception, match="torch digest"):
        ray.get(applied)
    why = err.value.failed["rollout-0"]
    assert "ChecksumError" in why and "bucket 0 of version 2" in why, why
    assert_serves(rs[0], TINY, 1)


@pytest.mark.parametrize("transport,digest", [("shm", "auto"), ("ipc", "torch"), ("broadcast", "torch")])
def test_version_digest_is_the_same_on_sender_and_every_receiver(start_job, transport, digest):
    job = _start(start_job, transport, digest, receivers=2)
    for v in (1, 2):
        job.step(v)
    seen = {v.version: (v.digest, v.receiver_digests) for v in job.coordinator.status().versions}
    kind = "xxh3" if digest == "auto" else digest
    assert all(sent.startswith(f"{kind}:") and got == {"rollout-0": sent, "rollout-1": sent}
               for sent, got in seen.values()), seen
