"""A simulated asynchronous accelerator, device kind ``sim``, for weightsync's tests; not part of
the package: it registers itself as any other accelerator would (weightsync.device.register),
in every process of a test job that has ``WEIGHTSYNC_DEVICE_MODULES=weightsync_sim`` and this
folder on its path (tests/conftest.py sets both before Ray starts, so its workers have them).

CI has no GPU and no NPU, and on the CPU every copy is synchronous and every event complete
at once, so the branches weightsync takes only on an accelerator (``device.Fences``,
``EventWork``, digests computed on the device and their host copies, device handles in the
ipc ring, loads onto a device, broadcast's event polling) never ran there. Under ``sim`` they
do, with the semantics of CUDA and torch_npu streams and events:

- device memory is host memory (a memfd per allocation, so it can be shared by handle), but
  a tensor on ``sim`` reports ``device.type == "sim"`` and mixing it with a CPU tensor in a
  computation fails as on a device (0-dim CPU scalars excepted, as on CUDA);
- every operation that reads or writes device memory is *queued* on the calling thread's
  current stream and runs later, in stream order, on the stream's own thread, after a seeded
  random lag (``SIMDEV_LAG_MS``, default 0-5 ms; ``SIMDEV_SEED``): a host
  that reads a buffer (another process through a handle, or a non-blocking copy to the host)
  before the event behind its writes completed sees stale bytes, as it could on a device;
- views and metadata are immediate; an op whose result the host needs (``.item()``,
  ``int(t)``, a blocking copy to the host, ``torch.equal``) synchronizes the stream first,
  as CUDA does;
- ``torch.sim.Event``: ``record()`` marks the stream's queue, ``query()`` stays False until
  the work queued before it ran, ``synchronize()`` waits for it, ``wait(stream)`` makes
  another stream wait (cudaStreamWaitEvent); ``torch.sim.current_stream()``,
  ``synchronize()``, ``Stream``, ``stream(s)`` as in ``torch.cuda``;
- a device tensor is shared between processes by handle: :func:`reduce_tensor` and
  :func:`rebuild_sim_tensor` take and give the arguments of torch's ``rebuild_cuda_tensor``,
  so the ipc transport's handle code (``ipc_wire``) runs unchanged.

The dispatch is torch's Python-only PrivateUse1 backend (``torch.utils.backend_registration``)
renamed ``sim``, with a wrapper subclass holding the host tensor. A process enables it by
resolving the device ``sim`` (``weightsync.device.resolve``), e.g. ``SyncConfig(device="sim")``;
its collective (backend ``simccl``, construction ``sim``) is gloo queued on the device's stream.
What it does not model: memory capacity, several devices, peer access, and the speed of
anything (its lags are there to reorder completions, not to time them).
"""

from __future__ import annotations

import threading
import types
from typing import Any

import torch

from .streams import (
    KIND,
    Event,
    Stream,
    configure,
    current_stream,
    default_stream,
    reset_streams,
    set_stream,
    stream,
    synchronize,
)
from .tensor import SimTensor, _copy_from, _copy_from_and_resize, _empty, _empty_strided, rebuild, reduce_args

__all__ = ["KIND", "Event", "SimTensor", "Stream", "configure", "current_stream", "enable", "enqueue", "host_of",
           "rebuild_sim_tensor", "reduce_tensor", "reset_streams", "stream", "synchronize"]

_enabled = False
_enable_lock = threading.Lock()
_library: Any = None


def enqueue(fn: Any) -> int:
    """Queue ``fn`` on the calling thread's current stream (a device collective's work)."""
    return current_stream().enqueue(fn)


def host_of(t: torch.Tensor) -> torch.Tensor:
    """The host tensor holding a sim tensor's bytes."""
    if not isinstance(t, SimTensor):
        raise TypeError(f"sim: not a sim tensor: {type(t).__name__}")
    return t.host


def reduce_tensor(t: torch.Tensor) -> tuple[Any, tuple[Any, ...]]:
    """(rebuild, args) for a sim tensor, as torch's ``reduce_tensor`` gives for a CUDA one."""
    return rebuild_sim_tensor, reduce_args(t)


def rebuild_sim_tensor(*args: Any, **kwargs: Any) -> torch.Tensor:
    """Open another process's sim tensor from :func:`reduce_tensor`'s arguments (those of
    torch's ``rebuild_cuda_tensor``)."""
    enable()
    return rebuild(*args, **kwargs)


def _module() -> types.ModuleType:
    m = types.ModuleType(f"torch.{KIND}")
    m.is_available = lambda: True
    m.device_count = lambda: 1
    m.current_device = lambda: 0
    m.set_device = lambda device: None
    m._is_in_bad_fork = lambda: False
    m.manual_seed_all = lambda seed: None
    m.get_rng_state = lambda device=None: torch.empty(0, dtype=torch.uint8)
    m.set_rng_state = lambda state, device=None: None
    m.is_initialized = lambda: True
    m.Stream, m.Event = Stream, Event
    m.current_stream, m.default_stream, m.set_stream, m.stream = current_stream, default_stream, set_stream, stream
    m.synchronize = synchronize
    return m


def enable() -> None:
    """Register the ``sim`` device in this process (idempotent)."""
    global _enabled, _library
    with _enable_lock:
        if _enabled:
            return
        from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

        if torch._C._get_privateuse1_backend_name() not in ("privateuseone", KIND):
            raise RuntimeError(f"sim: PrivateUse1 is taken by {torch._C._get_privateuse1_backend_name()!r}")
        if torch._C._get_privateuse1_backend_name() != KIND:
            _setup_privateuseone_for_python_backend(rename=KIND, backend_module=_module())
        _library = torch.library.Library("aten", "IMPL")
        _library.impl("empty.memory_format", _empty, "PrivateUse1")
        _library.impl("empty_strided", _empty_strided, "PrivateUse1")
        _library.impl("_copy_from", _copy_from, "PrivateUse1")
        _library.impl("_copy_from_and_resize", _copy_from_and_resize, "PrivateUse1")
        _enabled = True


# -- registered with weightsync, as a third-party accelerator is -----------------------------


class SimComm:
    """The sim device's collective: a broadcast queued on the device's current stream and seen
    through an event, as pynccl / pyhccl queue theirs; gloo moves the host bytes behind the
    device tensor when the stream gets there."""

    def __init__(self, store: Any, rank: int, size: int, device: torch.device, timeout: float):
        import datetime

        from weightsync.transports.broadcast.communicators import new_process_group

        self.pg = new_process_group("gloo", store, rank, size, datetime.timedelta(seconds=timeout))
        self.device = device

    def broadcast(self, tensor: torch.Tensor, timeout: float) -> Any:
        import datetime

        import torch.distributed as dist

        from weightsync import device as devices

        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        opts.timeout = datetime.timedelta(seconds=max(timeout, 0.001))
        host, pg = host_of(tensor), self.pg
        enqueue(lambda: pg.broadcast([host], opts).wait())
        return devices.EventWork(self.device)

    def abort(self) -> None:
        self.pg.abort()


def _current() -> torch.device:
    enable()
    return torch.device(KIND, 0)


def _register() -> None:
    from weightsync.device import registry

    registry.register(registry.Accelerator(
        kind=KIND, current=_current, count=lambda: 1,
        current_stream=lambda d: current_stream(d), synchronize=lambda d: synchronize(d), Stream=lambda d: Stream(d),
        stream=stream, Event=Event, set_device=lambda d: None, backend="simccl",
        visible_devices_var="SIMDEV_VISIBLE_DEVICES", rebuild=(__name__, "rebuild_sim_tensor"), reduce=reduce_tensor,
        ipc=lambda: (True, "the tests' simulated accelerator: memfd-backed device memory shared by handle"),
        address=lambda t: host_of(t).data_ptr(), pinned_host=False, caching_allocator=False,
        constructions={"sim": registry.Construction(
            what="the sim device's collective (tests): gloo under the device tensors, on the device stream",
            auto_why="auto on the tests' simulated accelerator: gloo queued on its stream, as pynccl queues NCCL",
            make=SimComm)},
    ))


_register()
