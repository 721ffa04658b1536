"""The pyhccl / pynccl constructions' rendezvous on CPU: vLLM's real StatelessProcessGroup
(0.11.0; 0.10.1 in tier vllm-0.10), built by weightsync.transports.broadcast.communicators on the session's
store (the sender hosts it, receivers dial the address the coordinator hands out), across real
processes. The communicators themselves need an NPU / a GPU (tests/test_groups.py)."""

from __future__ import annotations

import sys

import pytest
import ray
import torch

from weightsync.errors import ConfigError


class Member:
    """One party of the group, in its own process."""

    def __init__(self, rank: int):
        self.rank, self.store = rank, None

    def host(self) -> int:
        from weightsync.transports.broadcast.store import host_store

        self.store = host_store("127.0.0.1", 0, 30.0)
        return self.store.port

    def join(self, port: int, prefix: str, size: int, token: str | None) -> tuple[str, int]:
        import torch.distributed as dist

        from weightsync.transports.broadcast.communicators import stateless_group
        from weightsync.transports.broadcast.store import connect_store

        store = self.store if self.store is not None else connect_store("127.0.0.1", port, 30.0)
        group = stateless_group(dist.PrefixStore(prefix, store), self.rank, size)
        # what PyHcclCommunicator / PyNcclCommunicator do first: rank 0's unique id to all
        got = group.broadcast_obj(token if self.rank == 0 else None, src=0)
        group.barrier(timeout=30.0)
        return got, group.world_size


ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray workers cannot import this module


def test_stateless_group_rendezvous_on_our_store_across_processes(ray_cluster):
    cls = ray.remote(Member).options(num_cpus=0)
    members = [cls.remote(r) for r in range(3)]
    try:
        port = ray.get(members[0].host.remote(), timeout=60)
        out = ray.get([m.join.remote(port, "weightsync/s/e1", 3, "unique-id" if r == 0 else None)
                       for r, m in enumerate(members)], timeout=120)
        assert out == [("unique-id", 3)] * 3
    finally:
        for m in members:
            ray.kill(m)


def test_pynccl_without_a_gpu_is_a_clear_error_not_a_silent_no_op():
    # vLLM's PyNcclCommunicator disables itself when libnccl does not load, and a disabled
    # one's broadcast() returns without moving a byte: the group must refuse to build
    import torch.distributed as dist

    from weightsync.transports.broadcast.groups import Group
    from weightsync.transports.broadcast.store import host_store

    store = host_store("127.0.0.1", 0, 5.0)
    with pytest.raises(ConfigError, match="communicator 'pynccl': PyNcclCommunicator disabled itself"):
        Group.build("nccl", dist.PrefixStore("t", store), "t", 0, 2, torch.device("cpu"), 5.0, ["a", "b"],
                    communicator="pynccl")
