"""Internal. Everything device-specific that is not a transport: which platform this process runs on,
which physical device it holds, its streams and events. Kept in one place so the rest stays
device-agnostic; what each accelerator is comes from the registry (registry.py)."""

from __future__ import annotations

import collections
import contextlib
import ctypes
import logging
import os
from collections.abc import Callable
from typing import Any

import torch

from .registry import (  # noqa: F401  (a plugin's API: weightsync.device.register(Accelerator(...)))
    Accelerator,
    Construction,
    accelerator,
    backends,
    construction,
    constructions,
    kinds,
    npu_available,
    register,
)


def platform() -> str:
    """'npu', 'cuda' or 'cpu': the accelerator this process can use, NPU first (a registered
    accelerator is used where a config names it, never picked by 'auto')."""
    if npu_available():
        return "npu"
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


def resolve(device: str = "auto") -> torch.device:
    """The torch device for a config value; 'auto' is the current device of the platform."""
    kind = platform() if device == "auto" else device
    if kind == "cpu":
        return torch.device("cpu")
    acc = accelerator(kind)
    if acc is None:
        raise ValueError(f"unknown device kind {device!r}")
    return acc.current()


def address(t: torch.Tensor) -> int:
    """Where ``t``'s bytes start in memory: views of the same bytes give the same address."""
    acc = accelerator(t.device.type)
    return acc.address(t) if acc is not None else t.data_ptr()


def set_current(device: torch.device) -> None:
    """Make ``device`` current in the calling thread (the NPU current device is per thread)."""
    acc = accelerator(device.type)
    if acc is not None:
        acc.set_device(device)


def visible_devices_var(kind: str) -> str | None:
    acc = accelerator(kind)
    return acc.visible_devices_var if acc is not None else None


def physical_index(device: torch.device) -> int | None:
    """The physical device id behind a (possibly renumbered) logical index."""
    if device.type == "cpu" or device.index is None:
        return None
    var = visible_devices_var(device.type)
    listed = os.environ.get(var or "", "")
    ids = [x.strip() for x in listed.split(",") if x.strip()]
    if ids and device.index < len(ids) and ids[device.index].isdigit():
        return int(ids[device.index])
    return device.index


def local_index(kind: str, physical: int) -> int | None:
    """The logical index of physical device ``physical`` in this process, or None when this
    process cannot see it (the inverse of :func:`physical_index`)."""
    listed = os.environ.get(visible_devices_var(kind) or "", "")
    ids = [x.strip() for x in listed.split(",") if x.strip()]
    if ids:
        return ids.index(str(physical)) if str(physical) in ids else None
    return physical


def backend_for(kind: str) -> str:
    """The collective backend for a device kind ("cpu", "cuda", "npu"); gloo for anything else."""
    acc = accelerator(kind)
    return acc.backend if acc is not None else "gloo"


def _api(device: torch.device) -> Accelerator:
    acc = accelerator(device.type)
    if acc is None:
        raise ValueError(f"no streams on {device}")
    return acc


def current_stream(device: torch.device) -> Any:
    """The calling thread's current stream on an accelerator ``device``."""
    return _api(device).current_stream(device)


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device``'s current stream (no-op on CPU): what a
    bucket's copies wrote is visible to another process only after this."""
    if has_streams(device):
        _api(device).current_stream(device).synchronize()


def synchronize_device(device: torch.device) -> None:
    """Wait for every stream of ``device`` (no-op on CPU)."""
    if has_streams(device):
        _api(device).synchronize(device)


def record_event(device: torch.device, stream: Any = None) -> Any:
    """An event recorded on ``stream`` (None: ``device``'s current stream): done once the work
    queued there before it is (a torch.cuda.Event, torch.npu.Event, or a plugin's)."""
    api = _api(device)
    event = api.Event()
    event.record(api.current_stream(device) if stream is None else stream)
    return event


def has_streams(device: torch.device) -> bool:
    return accelerator(device.type) is not None


def new_stream(device: torch.device) -> Any:
    """A stream of its own on an accelerator ``device``: work queued there is not ordered with
    the other streams' (the engine's generation), only through events."""
    return _api(device).Stream(device)


def use_stream(device: torch.device, stream: Any) -> contextlib.AbstractContextManager[Any]:
    """Make ``stream`` the calling thread's current stream of ``device`` for the block, so every
    op, copy and collective issued there is queued on it (None, or no streams: unchanged)."""
    if stream is None or not has_streams(device):
        return contextlib.nullcontext()
    return _api(device).stream(stream)


def wait_event(event: Any, stream: Any) -> None:
    """Work queued on ``stream`` from now on runs after ``event``'s work; the host does not wait."""
    event.wait(stream)


def record_stream(t: torch.Tensor, stream: Any) -> None:
    """Tell the caching allocator that ``stream`` uses ``t`` (allocated on another stream): once
    freed, its memory is handed out again only after the work queued there by then is done.
    A device without a caching allocator (a queued op holds its tensors) skips it."""
    acc = accelerator(t.device.type)
    if acc is not None and acc.caching_allocator:
        t.record_stream(stream)


class EventWork:
    """Work enqueued on ``device``'s current stream, seen through an event recorded after it
    (the ``is_completed`` / ``wait`` of a torch.distributed Work)."""

    def __init__(self, device: torch.device):
        self.event = record_event(device)

    def is_completed(self) -> bool:
        return bool(self.event.query())

    def wait(self) -> None:
        self.event.synchronize()


ACL_FORMAT_ND = 2  # torch_npu's Format.ND: the plain layout; FRACTAL_NZ & co. are private


def npu_format(t: torch.Tensor) -> int:
    """The storage format torch_npu keeps ``t`` in (an int; torch_npu >= 2.7 wraps it in an IntEnum)."""
    import torch_npu

    return int(torch_npu.get_npu_format(t))


_HOST_REGISTER_READ_ONLY = 0x08  # cudaHostRegisterReadOnly: receivers map segments read-only
log = logging.getLogger(__name__)


def _clear_cuda_error() -> None:
    """Reset the thread's last CUDA error after a failed cudaHostRegister; torch checks it after
    its next kernel launch and would blame that kernel. The library is the one torch loaded."""
    try:
        with open("/proc/self/maps") as maps:
            path = next((line.split()[-1] for line in maps if "libcudart.so" in line), None)
        if path:
            ctypes.CDLL(path).cudaGetLastError()
    except Exception:
        pass


def pin_host(buf: torch.Tensor, device: torch.device, read_only: bool = False) -> Callable[[], None] | None:
    """Page-lock host memory we did not allocate (a shared-memory segment) for ``device``, so
    copies between it and device memory go straight to the DMA engine at full speed instead
    of through a staging buffer. Returns the undo, to call before the memory is unmapped, or
    None where this is not done (CPU, NPU: torch_npu exposes no host registration) or failed."""
    if device.type != "cuda" or buf.numel() == 0:
        return None
    cudart = torch.cuda.cudart()
    ptr, size = buf.data_ptr(), buf.numel() * buf.element_size()
    err = cudart.cudaHostRegister(ptr, size, _HOST_REGISTER_READ_ONLY if read_only else 0)
    if int(getattr(err, "value", err)) != 0:
        _clear_cuda_error()
        log.warning("weightsync: cudaHostRegister of %d bytes failed (%s); copies to %s stage through pageable "
                    "memory", size, err, device)
        return None
    return lambda: cudart.cudaHostUnregister(ptr)


def ray_options(kind: str, amount: float) -> dict[str, Any]:
    """Ray actor options asking for ``amount`` of one ``kind`` device (a fraction: parties
    sharing it, the colocated case); none for the CPU."""
    acc = accelerator(kind)
    return acc.ray_options(amount) if acc is not None else {}


def ray_resource(kind: str) -> str | None:
    """The name of the Ray resource a ``kind`` device is counted as ("GPU", "NPU"), from its
    accelerator's ``ray_options``; None where Ray counts none (the CPU, a simulated device)."""
    options = ray_options(kind, 1)
    if options.get("num_gpus"):
        return "GPU"
    return next(iter(options.get("resources") or {}), None)


def device_count(kind: str) -> int:
    acc = accelerator(kind)
    return acc.count() if acc is not None else 0


def describe(device: torch.device) -> dict[str, Any]:
    return {"type": device.type, "index": device.index, "physical": physical_index(device)}


class Fences:
    """Which numbered items (buckets, in order) a stream has finished: an event recorded after
    the work queued for items up to ``last`` (:meth:`mark`), instead of a synchronize per item.
    The host keeps queueing the next item's copies while an earlier one lands. On the CPU work
    is done when queued: every item is done at once, nothing is recorded."""

    def __init__(self, device: torch.device):
        self.device = device
        self.events: collections.deque[tuple[int, Any]] = collections.deque()

    def mark(self, last: int) -> None:
        """The work queued so far completes items up to ``last``."""
        if self.device.type != "cpu":
            self.events.append((last, record_event(self.device)))

    def done(self, item: int, block: bool) -> bool:
        """True once the work for ``item`` has landed; with ``block``, wait for it (on that
        item's event only, not the whole stream)."""
        while self.events and self.events[0][0] < item:
            self.events.popleft()
        if not self.events:
            return True  # CPU, or marked by nobody: nothing queued for it
        event = self.events[0][1]
        if event.query():
            return True
        if block:
            event.synchronize()
        return block

    def host_copy(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` (a device scalar, e.g. a digest) copied into pinned host memory behind the
        work queued so far: readable without a synchronize once a later :meth:`mark` is done."""
        if self.device.type == "cpu":
            return value
        # pinned, so the copy is asynchronous on CUDA / NPU (a device without pinned memory copies late anyway)
        host = torch.empty(value.shape, dtype=value.dtype, pin_memory=_api(self.device).pinned_host)
        host.copy_(value, non_blocking=True)
        return host
