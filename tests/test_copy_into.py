"""weightsync.CopyInto, the batched load offered to engines whose tensors take the trainer's as they
are: one torch._foreach_copy_ per bucket, the manifest checked against the same tensors."""

from __future__ import annotations

import pytest
import torch
from support.parties import same_bits
from test_reset_cache import CFG, MANIFEST, run
from weightsync_bench.layouts import materialize

from weightsync import CopyInto, ManifestError, SyncConfig, WeightReceiver, WeightSender
from weightsync.manifest import Manifest, TensorSpec


def test_copy_into_writes_every_pair_in_place_from_a_generator():
    params = {s.name: torch.zeros(s.shape, dtype=s.torch_dtype) for s in MANIFEST}
    kept = {n: t for n, t in params.items()}  # the engine's own tensors: written in place, never replaced
    weights = materialize(MANIFEST, seed=3)
    CopyInto(params).load_weights((n, t) for n, t in weights.items())
    assert all(params[n] is kept[n] and same_bits(params[n], w) for n, w in weights.items())


def test_a_receiver_loads_through_copy_into_bit_exact(coordinator_factory):
    coord = coordinator_factory(CFG)
    params = {s.name: torch.zeros(s.shape, dtype=s.torch_dtype) for s in MANIFEST}
    receiver = WeightReceiver(coord, CopyInto(params), name="local", config=SyncConfig.load(CFG))
    sender = WeightSender(coord, expected_receivers=1, config=SyncConfig.load(CFG))
    try:
        for v in (1, 2):
            weights, failed, errors = run(receiver, sender, v)
            assert failed is None and not errors and receiver.version == v
            assert all(same_bits(params[n], w) for n, w in weights.items())
    finally:
        receiver.close()
        sender.close()


def test_copy_into_lends_its_tensors_to_the_manifest_check(coordinator_factory):
    coord = coordinator_factory(CFG)
    first = MANIFEST.specs[0]
    wrong = Manifest((TensorSpec(first.name, "float32", first.shape),) + MANIFEST.specs[1:])
    params = {s.name: torch.zeros(s.shape, dtype=s.torch_dtype) for s in wrong}
    receiver = WeightReceiver(coord, CopyInto(params), name="local", config=SyncConfig.load(CFG))
    sender = WeightSender(coord, expected_receivers=1, config=SyncConfig.load(CFG))
    try:
        sender.stage(1, materialize(MANIFEST, seed=1))
        with pytest.raises(ManifestError, match=f"tensor '{first.name}' has dtype bfloat16, the receiver expects float32"):
            receiver.apply(1, timeout=30)
    finally:
        receiver.close()
        sender.close()
