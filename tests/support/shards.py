"""Trainer ranks whose weights are FSDP2 shards: one process group (gloo) over the ranks, a 1-D
device mesh, every tensor of one or more dimensions a DTensor sharded by rows (``Shard(0)``), as
FSDP2's ``fully_shard`` leaves a model's parameters; 0-dim tensors stay plain tensors every rank
holds. Real torch.distributed, real weightsync parties; only the model is a dict."""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from weightsync_bench.layouts import materialize

from weightsync.config import SyncConfig
from weightsync.coordinator.client import Coordinator
from weightsync.manifest import Manifest, TensorSpec, chunk_bounds
from weightsync.sender import SyncResult, WeightSender

from .parties import Gate, _Party

# uneven on purpose: rows not divisible by the ranks, fewer rows than ranks, a 0-dim tensor, a
# tensor split over buckets, buckets shared by several ranks' rows
SPECS = (TensorSpec("embed", "bfloat16", (1000, 48)), TensorSpec("norm", "float32", (10,)),
         TensorSpec("tiny", "bfloat16", (2, 3)), TensorSpec("scale", "float32", ()),
         TensorSpec("proj", "float32", (7, 33)), TensorSpec("count", "int64", (5,)))
MANIFEST = Manifest(SPECS)


def sharded(ranks: int) -> Manifest:
    """MANIFEST split over ``ranks`` as Shard(0) splits it."""
    return Manifest(SPECS, tuple(chunk_bounds(s.shape[0], ranks) if s.shape else (0,) + (1,) * ranks
                                 for s in SPECS))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ShardedTrainer(_Party):
    """Trainer rank ``rank`` of ``ranks``; version v's full weights are ``materialize(manifest, seed=v)``
    (every rank computes them, then keeps only its rows, as the sharded optimizer step leaves them)."""

    def __init__(self, coordinator: Coordinator, manifest_wire: list, rank: int, ranks: int, port: int,
                 config: dict | None = None, expected_receivers: int | None = None):
        import torch.distributed as dist
        import torch.distributed.tensor  # noqa: F401  an FSDP2 trainer has it loaded before its first version
        from torch.distributed.device_mesh import init_device_mesh

        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the ranks meet on this host
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ranks)
        self.mesh = init_device_mesh("cpu", (ranks,))
        self.manifest = Manifest.from_wire(manifest_wire)
        cfg = SyncConfig.load(config) if config is not None else None
        self.sender = WeightSender(coordinator, rank=rank, config=cfg, expected_receivers=expected_receivers)
        self.gate = Gate()

    def shards(self, version: int) -> dict[str, Any]:
        from torch.distributed.tensor import Shard, distribute_tensor

        full = materialize(self.manifest, seed=version)
        # src_data_rank=None: every rank cuts its rows from its own copy, no collective
        return {n: distribute_tensor(t, self.mesh, [Shard(0)], src_data_rank=None) if t.dim() else t
                for n, t in full.items()}

    def stage(self, version: int, gather: bool = False) -> float:
        """Stage ``version`` from this rank's shards (``gather``: their ``full_tensor()``s, as the
        verl workers pass them today). A fault point (hold_at) stops the walk before tensor i."""
        named: Any = self.shards(version)
        if gather:
            named = ((n, t.full_tensor() if hasattr(t, "full_tensor") else t) for n, t in named.items())
        if self.gate.at:
            gate, items = self.gate, named.items() if isinstance(named, dict) else named
            named = ((n, t) for i, (n, t) in enumerate(items) if gate.pass_((i,)) is None)
        return self.sender.stage(version, named).wait()

    def hold_at(self, tensor: int) -> None:
        self.gate = Gate(tensor)

    def sync(self, version: int, timeout: float | None = None) -> SyncResult:
        return self.sender.sync(version, timeout=timeout)

    def step(self, version: int, gather: bool = False, delay_s: float = 0.0) -> tuple[float, float]:
        """(seconds from the start of staging until stage() returned, until sync() returned),
        staging after ``delay_s``."""
        time.sleep(delay_s)
        t0 = time.perf_counter()
        self.stage(version, gather)
        staged = time.perf_counter() - t0
        self.sync(version)
        return staged, time.perf_counter() - t0

    def corrupt_rows_digests(self) -> None:
        """From now on this rank sends its rows with a wrong digest (one bit off), as bytes
        changed on their way would arrive (sharded relay and broadcast: transports/relay/transport.py,
        transports/broadcast/rows.py)."""
        from weightsync.transports.broadcast import rows as broadcast
        from weightsync.transports.relay import transport as relay

        honest = relay.put_checksum

        def wrong(buf, n, value=None, kind="xxh3"):
            value = honest(buf, n, value, kind) ^ 1
            return honest(buf, n, value, kind)

        relay.put_checksum = broadcast.put_checksum = wrong

    def sharded(self) -> bool:
        return self.sender.rows is not None

    def written(self) -> int:
        """Bytes this rank wrote into segments so far."""
        return self.sender.transport.packed_bytes if self.sender.transport is not None else 0

    def close(self) -> None:
        import torch.distributed as dist

        try:
            self.sender.close()
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()

    def _party(self) -> WeightSender:
        return self.sender


def sharded_trainers(coordinator: Coordinator, manifest: Manifest, ranks: int, config: dict | None = None,
                     receivers: int | None = None, options: Any = None) -> list:
    """``options(rank)``: more Ray options for that rank's actor (e.g. which simulated device it holds).
    Returns once every rank is up: on a loaded machine starting a rank (torch, its process group, DTensor)
    takes tens of seconds, which must not count against a version's sync timeout."""
    import ray

    port = free_port()
    trainers = [ray.remote(ShardedTrainer).options(num_cpus=0, max_concurrency=4, **(options(r) if options else {})).remote(
        coordinator, manifest.to_wire(), r, ranks, port, config=config, expected_receivers=receivers)
        for r in range(ranks)]
    ray.get([t.pid.remote() for t in trainers], timeout=300)
    return trainers

