"""Internal. Which communicator builds the broadcast transport's group, and the communicators themselves:
the only per-device part of that transport.

Five constructions, one interface (``broadcast(tensor, timeout) -> work``, ``abort``):

- ``torch``: torch's own ProcessGroup class on our store: gloo on CPU, NCCL on CUDA.
- ``torch_npu``: torch_npu's ``ProcessGroupHCCL`` on our store.
- ``pyhccl``: vLLM's ``StatelessProcessGroup`` on our store + vllm-ascend's
  ``PyHcclCommunicator(group, device)``, ``broadcast(tensor, src, stream)`` in place. This is
  how verl (one-step-off recipe from v0.7.0, ``distributed_util.vllm_stateless_init_process_group``)
  and vllm-ascend's HCCL weight-transfer engine build it on the user's Ascend stack, so it is
  the default on NPU when ``vllm_ascend`` imports.
- ``pynccl``: the same with vLLM's ``PyNcclCommunicator`` on CUDA.

The communicators of vLLM / vllm-ascend have no timeout of their own: each broadcast is
followed by a device event that the transport polls against its deadline (groups.py).
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ... import device as devices
from ...errors import ConfigError
from .store import node_address

if TYPE_CHECKING:  # the types below let tests/conformance check each use against these classes' source
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.distributed.utils import StatelessProcessGroup
    from vllm_ascend.distributed.device_communicators.pyhccl import PyHcclCommunicator

# the constructions each built-in backend has, preferred first (a registered accelerator brings
# those of its own backend: device.Accelerator.constructions)
CONSTRUCTIONS = {"gloo": ("torch",), "nccl": ("torch", "pynccl"), "hccl": ("pyhccl", "torch_npu")}
_STATELESS = {  # construction -> (module, class) of its communicator
    "pyhccl": ("vllm_ascend.distributed.device_communicators.pyhccl", "PyHcclCommunicator"),
    "pynccl": ("vllm.distributed.device_communicators.pynccl", "PyNcclCommunicator"),
}
AUTO_WHY = {
    ("gloo", "torch"): "gloo: torch ProcessGroupGloo, its only construction",
    ("nccl", "torch"): "auto on CUDA: torch ProcessGroupNCCL, which has timeouts and abort of its own; pynccl on request",
    ("hccl", "pyhccl"): "auto on NPU: pyhccl, the construction verl >= 0.7 and vllm-ascend run on the user's stack",
    ("hccl", "torch_npu"): "auto on NPU: torch_npu ProcessGroupHCCL",
}
WHAT = {
    "torch": "torch ProcessGroup (gloo / NCCL) on the session's store",
    "torch_npu": "torch_npu ProcessGroupHCCL on the session's store",
    "pyhccl": "vLLM StatelessProcessGroup + vllm-ascend PyHcclCommunicator (as verl >= 0.7 and vllm-ascend build it)",
    "pynccl": "vLLM StatelessProcessGroup + vLLM PyNcclCommunicator",
}


def _options(backend: str) -> tuple[str, ...] | None:
    return CONSTRUCTIONS.get(backend) or devices.constructions(backend) or None


def _why_auto(backend: str, name: str) -> str:
    registered = devices.construction(name)
    return registered.auto_why if registered is not None else AUTO_WHY[(backend, name)]


def _what(name: str) -> str:
    registered = devices.construction(name)
    return registered.what if registered is not None else WHAT[name]


# -- which construction ----------------------------------------------------------------


def choose_backend(requested: str, device: torch.device) -> str:
    """The backend for a config value: ``auto`` follows the sender's device."""
    if requested != "auto":
        return requested
    return devices.backend_for(device.type)


def comm_device(backend: str, device: torch.device, who: str) -> torch.device:
    """Where this party's bucket buffers live: the communicator's device."""
    want = next((k for k in devices.kinds() if k != "cpu" and devices.backend_for(k) == backend), None)
    if want is None:
        return torch.device("cpu")  # gloo moves host buffers whatever the engine's device
    if device.type != want:
        raise ConfigError(f"backend '{backend}' needs {want} devices, but {who} runs on {device.type}; "
                          f"set backend: gloo, or place {who} on a {want} device")
    return device


def probe(name: str) -> str | None:
    """Why construction ``name`` cannot be built in this process, or None if it can."""
    try:
        if name == "torch_npu":
            importlib.import_module("torch_npu._C._distributed_c10d").ProcessGroupHCCL  # noqa: B018
        elif name in _STATELESS:
            importlib.import_module("vllm.distributed.utils").StatelessProcessGroup  # noqa: B018
            module, cls = _STATELESS[name]
            getattr(importlib.import_module(module), cls)
    except Exception as exc:  # ImportError, or a platform plugin that fails on import
        return f"{type(exc).__name__}: {exc}"[:300]
    return None


def choose_communicator(requested: str, backend: str, probe: Callable[[str], str | None] = probe) -> tuple[str, str]:
    """(construction, why) for ``backend``. ``auto`` takes the backend's first construction
    that can be built here; an explicit one that cannot is a ConfigError with the reason."""
    options = _options(backend)
    if options is None:
        raise ConfigError(f"unknown collective backend {backend!r}")
    if requested != "auto":
        if requested not in options:
            raise ConfigError(f"communicator '{requested}' does not build a '{backend}' group; "
                              f"backend '{backend}' takes {' or '.join(options)}")
        why_not = probe(requested)
        if why_not:
            raise ConfigError(f"communicator '{requested}' cannot be built here: {why_not}")
        return requested, f"communicator: {requested} (set in the config)"
    skipped = []
    for name in options:
        why_not = probe(name)
        if why_not is None:
            return name, _why_auto(backend, name) + "".join(f"; {s}" for s in skipped)
        skipped.append(f"{name} not available ({why_not})")
    raise ConfigError(f"no '{backend}' group can be built here: " + "; ".join(skipped))


def constructions(backend: str, probe: Callable[[str], str | None] = probe) -> dict[str, dict[str, bool | str]]:
    """Every construction of ``backend`` and whether it can be built here (for doctor: its
    JSON report shows ``available``, ``what`` and, where not, ``reason``)."""
    out = {}
    for name in _options(backend) or ():
        why_not = probe(name)
        out[name] = {"available": why_not is None, "what": _what(name), **({"reason": why_not} if why_not else {})}
    return out


# -- the constructions -------------------------------------------------------------------


def new_process_group(backend: str, store: Any, rank: int, size: int, timeout: datetime.timedelta) -> Any:
    """A standalone torch ProcessGroup of ``backend``; needs the device set in this thread."""
    if backend == "gloo":
        # gloo binds what the hostname resolves to, often a loopback address ("127.0.1.1 host"
        # in /etc/hosts) that other nodes cannot reach: bind the Ray node address instead,
        # unless GLOO_SOCKET_IFNAME names the interface
        bind = None if os.environ.get("GLOO_SOCKET_IFNAME") else node_address()
        if bind is None:
            return dist.ProcessGroupGloo(store, rank, size, timeout)
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout, opts._devices = timeout, [dist.ProcessGroupGloo.create_device(hostname=bind)]
        return dist.ProcessGroupGloo(store, rank, size, opts)
    if backend == "nccl":
        if not dist.is_nccl_available():
            raise ConfigError("backend 'nccl' requested but this torch build has no NCCL")
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, opts)
    if backend == "hccl":
        try:
            import torch_npu  # noqa: F401  (registers the npu device)
            from torch_npu._C._distributed_c10d import ProcessGroupHCCL
        except ImportError as exc:
            raise ConfigError(f"backend 'hccl' needs torch_npu: {exc}") from None
        hccl_opts = ProcessGroupHCCL.Options()
        hccl_opts._timeout = timeout
        return ProcessGroupHCCL(store, rank, size, hccl_opts)
    raise ConfigError(f"unknown collective backend {backend!r}")


def stateless_group(store: Any, rank: int, size: int) -> StatelessProcessGroup:
    """vLLM's StatelessProcessGroup on our (prefixed) store, not on a store of its own."""
    from vllm.distributed.utils import StatelessProcessGroup

    # vLLM <= 0.11 keeps the store's listening socket in a required field; from 0.23
    # (vllm-ascend 0.23's) the field is gone and passing it is a TypeError
    fields = {f.name for f in dataclasses.fields(StatelessProcessGroup)}
    owned = {"socket": None} if "socket" in fields else {}
    return StatelessProcessGroup(rank=rank, world_size=size, store=store, **owned)


class _TorchComm:
    def __init__(self, pg: Any):
        self.pg = pg

    def broadcast(self, tensor: torch.Tensor, timeout: float) -> Any:
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        opts.timeout = datetime.timedelta(seconds=max(timeout, 0.001))
        return self.pg.broadcast([tensor], opts)

    def abort(self) -> None:
        self.pg.abort()


class _StatelessComm:
    def __init__(self, name: str, store: Any, rank: int, size: int, device: torch.device):
        module, cls = _STATELESS[name]
        communicator: type[PyHcclCommunicator | PyNcclCommunicator] = getattr(importlib.import_module(module), cls)
        self.name, self.device, self.group = name, device, stateless_group(store, rank, size)
        # rank 0 makes the unique id and broadcast_obj()s it through our store; then the
        # communicator's init and warm-up all_reduce block until every rank is in them
        self.comm: PyHcclCommunicator | PyNcclCommunicator = communicator(self.group, device=device)
        if getattr(self.comm, "disabled", False) or not getattr(self.comm, "available", True):
            # both classes disable themselves silently when the library does not load, and a
            # disabled one's broadcast() returns without moving a byte
            raise ConfigError(f"communicator '{name}': {cls} disabled itself on {device} (its library did not "
                              f"load); choose communicator: {'torch_npu' if name == 'pyhccl' else 'torch'}")

    def broadcast(self, tensor: torch.Tensor, timeout: float) -> devices.EventWork:
        self.comm.broadcast(tensor, src=0, stream=devices.current_stream(self.device))
        # the transport polls the event against its deadline (these communicators have none)
        return devices.EventWork(self.device)

    def abort(self) -> None:
        # called only once the group's ops ended: destroying a communicator with ops in
        # flight is undefined, so a stuck one is left to the process's exit
        if getattr(self.comm, "comm", None) is None:  # a disabled communicator has none
            return
        if self.name == "pyhccl":
            hccl: PyHcclCommunicator = self.comm
            hccl.hccl.hcclCommDestroy(hccl.comm)
        else:
            nccl: PyNcclCommunicator = self.comm
            nccl.nccl.ncclCommDestroy(nccl.comm)
        self.comm.comm = None


def make_comm(communicator: str, backend: str, store: Any, rank: int, size: int, device: torch.device,
              timeout: float) -> Any:
    """The communicator ``communicator`` of ``backend`` on ``store``; blocks until every rank is in it."""
    registered = devices.construction(communicator)
    if registered is not None:
        return registered.make(store, rank, size, device, timeout)
    if communicator in _STATELESS:
        return _StatelessComm(communicator, store, rank, size, device)
    return _TorchComm(new_process_group(backend, store, rank, size, datetime.timedelta(seconds=timeout)))
