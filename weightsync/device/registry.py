"""The accelerators weightsync runs on: what each is (``Accelerator``: its stream and event API, its
collective backend, how its memory is shared by handle), CUDA and NPU built in, and the registry
another accelerator joins with :func:`register`, from a module named in ``WEIGHTSYNC_DEVICE_MODULES``
(docs/platforms.md, "Registering an accelerator"). The accelerator plugin interface: public."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import os
import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch

ENV = "WEIGHTSYNC_DEVICE_MODULES"  # comma-separated modules that register accelerators (docs/platforms.md)


@dataclasses.dataclass(frozen=True)
class Construction:
    """A way to build the collective group of a registered accelerator's backend, for the
    broadcast transport (transports/broadcast/communicators.py)."""

    what: str  # for doctor
    auto_why: str  # the reason status() shows when ``communicator: auto`` picks it
    # (store, rank, size, device, timeout_s) -> a communicator: broadcast(tensor, timeout_s) -> a
    # Work (is_completed(), wait()), and abort()
    make: Callable[[Any, int, int, torch.device, float], Any]


@dataclasses.dataclass(frozen=True)
class Accelerator:
    """An accelerator weightsync runs on: torch device type ``kind``, its stream and event API,
    the collective backend between its devices, and how its memory is shared by handle. CUDA
    and NPU are built in; another registers with :func:`register` in every process of a job,
    through a module named in ``WEIGHTSYNC_DEVICE_MODULES`` (imported when a device is first
    looked up): docs/platforms.md, "Registering an accelerator".

    The API callables take a ``torch.device`` of the kind where they say so, as ``torch.cuda``'s
    functions do: ``current_stream(device)``, ``synchronize(device)`` (every stream of it),
    ``Stream(device)``, ``stream(s)`` (a context making ``s`` current), ``Event()`` (with
    ``record(stream)``, ``query()``, ``synchronize()``, ``wait(stream)``), ``set_device``."""

    kind: str
    current: Callable[[], torch.device]  # this process's current device of the kind
    count: Callable[[], int]  # devices this process can see (0: none, or the runtime is missing)
    current_stream: Callable[[torch.device], Any]
    synchronize: Callable[[torch.device], None]
    Stream: Callable[[torch.device], Any]
    stream: Callable[[Any], contextlib.AbstractContextManager[Any]]
    Event: Callable[[], Any]
    set_device: Callable[[torch.device], None]
    backend: str  # the collective backend that moves bytes between devices of the kind
    visible_devices_var: str | None = None  # renumbers the devices a process sees (CUDA_VISIBLE_DEVICES)
    # ipc: a receiver opens a sender's handle with this function (module, name), and only this;
    # ``reduce``: the sender's export (torch.multiprocessing.reductions.reduce_tensor when None)
    rebuild: tuple[str, str] | None = None
    reduce: Callable[[torch.Tensor], tuple[Any, tuple[Any, ...]]] | None = None
    ipc: Callable[[], tuple[bool, str]] = lambda: (False, "no ipc on this device kind")
    address: Callable[[torch.Tensor], int] = torch.Tensor.data_ptr  # where a tensor's bytes start
    pinned_host: bool = True  # host copies queued behind its streams use page-locked memory
    caching_allocator: bool = True  # freed memory waits for the streams that used it (record_stream)
    ray_options: Callable[[float], dict[str, Any]] = lambda amount: {}  # Ray actor options for a share of one
    # the constructions of ``backend``'s group, preferred first (built-in backends have theirs in
    # transports/broadcast/communicators.py)
    constructions: Mapping[str, Construction] = dataclasses.field(default_factory=dict)


_REGISTRY: dict[str, Accelerator] = {}
_plugins_loaded = False
_plugins_lock = threading.Lock()


def register(accelerator: Accelerator) -> None:
    """Make ``accelerator.kind`` a device weightsync runs on, in this process."""
    _REGISTRY[accelerator.kind] = accelerator


def _load_plugins() -> None:
    global _plugins_loaded
    with _plugins_lock:
        if _plugins_loaded:
            return
        _plugins_loaded = True
        for name in filter(None, (m.strip() for m in os.environ.get(ENV, "").split(","))):
            importlib.import_module(name)  # registers its accelerator


def accelerator(kind: str) -> Accelerator | None:
    """The registered accelerator of device type ``kind`` (None: the CPU, or not registered)."""
    if kind not in _REGISTRY and kind != "cpu":
        _load_plugins()
    return _REGISTRY.get(kind)


def kinds() -> tuple[str, ...]:
    """Every device kind a config may name: the CPU and each registered accelerator."""
    _load_plugins()
    return ("cpu", *_REGISTRY)


def backends() -> tuple[str, ...]:
    """The collective backends of the registered accelerators."""
    _load_plugins()
    return tuple(dict.fromkeys(a.backend for a in _REGISTRY.values()))


def constructions(backend: str | None = None) -> tuple[str, ...]:
    """The registered constructions (of ``backend``'s group only, where given)."""
    _load_plugins()
    return tuple(name for a in _REGISTRY.values() if backend in (None, a.backend) for name in a.constructions)


def construction(name: str) -> Construction | None:
    _load_plugins()
    return next((a.constructions[name] for a in _REGISTRY.values() if name in a.constructions), None)


def npu_available() -> bool:
    if importlib.util.find_spec("torch_npu") is None:
        return False
    try:
        import torch_npu  # noqa: F401  (registers torch.npu)

        return bool(torch.npu.is_available())
    except Exception:
        return False


def _current_npu() -> torch.device:
    import torch_npu  # noqa: F401

    return torch.device("npu", torch.npu.current_device())


register(Accelerator(
    kind="cuda", current=lambda: torch.device("cuda", torch.cuda.current_device()),
    count=lambda: torch.cuda.device_count() if torch.cuda.is_available() else 0,
    current_stream=torch.cuda.current_stream, synchronize=torch.cuda.synchronize, Stream=torch.cuda.Stream,
    stream=torch.cuda.stream, Event=torch.cuda.Event, set_device=torch.cuda.set_device, backend="nccl",
    visible_devices_var="CUDA_VISIBLE_DEVICES", rebuild=("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
    ray_options=lambda amount: {"num_gpus": amount}))
# named, not looked up: tests/conformance checks every NPU call by its name
register(Accelerator(
    kind="npu", current=_current_npu, count=lambda: torch.npu.device_count() if npu_available() else 0,
    current_stream=lambda d: torch.npu.current_stream(d), synchronize=lambda d: torch.npu.synchronize(d),
    Stream=lambda d: torch.npu.Stream(d), stream=lambda s: torch.npu.stream(s), Event=lambda: torch.npu.Event(),
    set_device=lambda d: torch.npu.set_device(d), backend="hccl", visible_devices_var="ASCEND_RT_VISIBLE_DEVICES",
    rebuild=("torch_npu.multiprocessing.reductions", "rebuild_npu_tensor"),
    ray_options=lambda amount: {"resources": {"NPU": amount}}))
