"""Internal. How the broadcast transport's group is built, waited on and retired: the rendezvous of one
epoch's group (checked by a first broadcast), waiting on its collectives while asking the
coordinator whether the version is still on, and letting a broken group's ops end off the
caller's path. Which communicator it runs on is :mod:`.communicators`; the store is
:mod:`.group_store`.

Rendezvous always goes through the sender's store, whose address the coordinator hands out:
the StatelessProcessGroup is built on a PrefixStore of it (not ``StatelessProcessGroup.create``,
which would host a second store). The communicators of vLLM / vllm-ascend have no timeout
of their own: they are built in the transport's helper thread, and each broadcast is
followed by a device event that the transport polls against its deadline, so a stalled
peer still becomes an error that names it. A stuck op cannot be cancelled; its group is
abandoned (and destroyed once its ops end) and the next version re-forms without the peer.
"""

from __future__ import annotations

import contextlib
import threading
import time
import zlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ... import device as devices
from ...errors import ConfigError, DeadlineExceeded, ProtocolError
from .communicators import make_comm


class Group:
    """One epoch's group: built once, reused for every version of that epoch."""

    def __init__(self, comm: Any, backend: str, epoch: Any, rank: int, size: int, device: torch.device,
                 communicator: str = "torch"):
        self.comm, self.backend, self.epoch, self.rank, self.size, self.device = comm, backend, epoch, rank, size, device
        self.communicator = communicator

    @classmethod
    def build(cls, backend: str, store: Any, prefix: str, rank: int, size: int, device: torch.device,
              timeout: float, names: list[str], communicator: str = "torch") -> Group:
        """Rendezvous under ``prefix`` and check it with a first broadcast of the epoch tag,
        so a lazily connecting backend (NCCL, HCCL) connects here too, not in bucket 0.
        Raises naming the members that never showed up."""
        devices.set_current(device)  # HCCL and NCCL use the thread's current device
        scoped = dist.PrefixStore(prefix, store)
        scoped.set(f"joined/{rank}", names[rank])
        try:
            comm = make_comm(communicator, backend, scoped, rank, size, device, timeout)
            group = cls(comm, backend, 0, rank, size, device, communicator)
            tag = torch.tensor([_tag(prefix) if rank == 0 else -1], dtype=torch.int64, device=device)
            group.broadcast(tag, timeout).wait()
        except ConfigError:
            raise
        except Exception as exc:
            try:
                missing = [names[r] for r in range(size) if not scoped.check([f"joined/{r}"])]
            except Exception:
                missing = []  # the store itself is gone (the sender died): the error says so
            if missing:
                raise DeadlineExceeded(f"broadcast group {prefix!r}: {', '.join(missing)} never joined "
                                       f"within {timeout:.1f}s") from exc
            raise
        if int(tag.item()) != _tag(prefix):
            raise ProtocolError(f"broadcast group {prefix!r}: rank {rank} met another group's traffic")
        return group

    @classmethod
    def build_polled(cls, backend: str, store: Any, prefix: str, rank: int, size: int, device: torch.device,
                     timeout: float, names: list[str], communicator: str, poll: Callable[[], None],
                     what: str) -> Group:
        """:meth:`build` in a helper thread while this one keeps calling ``poll()`` (which
        raises if the version was aborted meanwhile): a rendezvous can wait on a dead peer."""
        box: dict[str, Group | BaseException] = {}
        # the rendezvous' first broadcast goes on the caller's stream (the ahead thread's own
        # one, ahead.py), not on the helper thread's default stream, the engine's on CUDA
        stream = devices.current_stream(device) if devices.has_streams(device) else None

        def run() -> None:
            try:
                with devices.use_stream(device, stream):
                    box["group"] = cls.build(backend, store, prefix, rank, size, device, timeout, names,
                                             communicator)
            except BaseException as exc:
                box["error"] = exc

        thread = threading.Thread(target=run, name=f"weightsync-bcast-build-{names[rank]}", daemon=True)
        thread.start()
        limit = time.monotonic() + timeout + 1.0
        while thread.is_alive():
            thread.join(POLL_S)
            if thread.is_alive():
                if time.monotonic() >= limit:
                    raise DeadlineExceeded(f"{what} took over {timeout:.1f}s")
                poll()
        if "error" in box:
            raise box["error"]
        return box["group"]

    def broadcast(self, tensor: torch.Tensor, timeout: float) -> Any:
        return self.comm.broadcast(tensor, timeout)

    def abort(self) -> None:
        self.comm.abort()


def _tag(prefix: str) -> int:
    return zlib.crc32(prefix.encode()) & 0x7FFFFFFF


# -- waiting on collectives ------------------------------------------------------------

POLL_S = 0.25  # how long a collective may be silent before we ask the coordinator why


def settle(work: Any, deadline: float, poll: Callable[[], None], what: str) -> None:
    """Wait for a collective; while it is slow, ``poll()`` (raises if the version is off)."""
    done = threading.Event()
    try:
        work.get_future().add_done_callback(lambda _: done.set())
        wait = done.wait
    except (RuntimeError, AttributeError):  # a backend without futures: poll the work
        def wait(limit: float) -> bool:
            end = time.monotonic() + limit
            while not work.is_completed() and time.monotonic() < end:
                time.sleep(1e-4)
            return work.is_completed()
    while not wait(max(0.0, min(POLL_S, deadline - time.monotonic()))):
        if time.monotonic() >= deadline:
            raise DeadlineExceeded(f"{what} did not complete before the deadline")
        poll()
    # raises the op's own error; on a device it orders the current stream after the op
    try:
        work.wait()
    except Exception as exc:
        # the op's own timeout is what the deadline had left when it was posted: an op that
        # ended in an error past the deadline (gloo's "Timed out waiting ..." firing while
        # poll() was asking the coordinator) ran out of the deadline, and says so
        if time.monotonic() >= deadline:
            raise DeadlineExceeded(f"{what} did not complete before the deadline ({exc})") from exc
        raise


def retire(group: Group | None, works: list[Any], what: str) -> None:
    """Let a broken group's pending ops end (error or their own timeout) off the caller's
    path: a gloo group's destructor waits for them, and they may still write into buffers
    that the caller has already replaced."""
    if group is None and not works:
        return
    # a torch NCCL work's wait() makes the waiting thread's current stream wait for the op: the
    # retiring caller's (the ahead thread's own stream), never the engine's default one
    device = group.device if group is not None else None
    stream = devices.current_stream(device) if device is not None and devices.has_streams(device) else None

    def drain() -> None:
        with devices.use_stream(device, stream) if device is not None else contextlib.nullcontext():
            for w in works:
                try:
                    w.wait()
                except Exception:
                    pass
        try:
            if group is not None:
                group.abort()
        except Exception:
            pass

    threading.Thread(target=drain, name=f"weightsync-retire-{what}", daemon=True).start()
