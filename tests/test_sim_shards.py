"""Rows of a sharded version that live on an accelerator: each rank's copy of its rows into the
host segment has landed when RowWriter.fill returns (the last writer digests the bucket right
after), on the simulated asynchronous accelerator, whose copies run late on a stream."""

from __future__ import annotations

import pytest
import torch
from weightsync_bench.layouts import materialize

from support.parties import assert_same_weights
from support.shards import MANIFEST, sharded
from weightsync import device as devices
from weightsync.manifest import RowWriter, Unpacker, plan_buckets, plan_rows

pytestmark = pytest.mark.sim


@pytest.mark.parametrize("ranks", [2, 3])
def test_rows_copied_from_the_device_have_landed_when_fill_returns(ranks):
    dev = devices.resolve("sim")
    manifest = sharded(ranks)
    plan = plan_buckets(manifest, 4096, 256)
    full = materialize(MANIFEST, seed=7)
    buffers = [torch.zeros(b.nbytes, dtype=torch.uint8) for b in plan.buckets]
    for rank in range(ranks):
        local = [(s.name, (full[s.name][r[rank]: r[rank + 1]] if s.shape else full[s.name]).to(dev))
                 for s, r in zip(manifest.specs, manifest.rows)]
        writer = RowWriter(plan_rows(plan, manifest, rank), manifest, local)
        for b in writer.buckets:
            writer.fill(b, buffers[b])
    got = {}
    unpacker = Unpacker(plan, manifest)
    for b, buf in enumerate(buffers):
        got.update((n, t.clone()) for n, t in unpacker.unpack(b, buf))
    assert_same_weights(got, full, "rows copied from the simulated device")
