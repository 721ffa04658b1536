"""Transport registry. Each transport is one module exposing a sender and a receiver class;
modules are imported on first use, so a transport's optional dependencies (torch_npu, ...)
are needed only when it is chosen. ``SyncConfig(transport=...)`` accepts exactly the names
registered here (and "auto"), so a transport registered by a plugin can be selected."""

from __future__ import annotations

import importlib

from .base import ReceiverTransport, SenderTransport, TransportContext

_MODULES = {
    "shm": ("weightsync.transports.shm", "ShmSender", "ShmReceiver"),
    "broadcast": ("weightsync.transports.broadcast", "BroadcastSender", "BroadcastReceiver"),
    "ipc": ("weightsync.transports.ipc", "IpcSender", "IpcReceiver"),
}


def register_transport(name: str, module: str, sender: str, receiver: str) -> None:
    """Make ``name`` selectable: ``module`` (imported on first use) defines the ``sender`` and
    ``receiver`` classes. Every party of a job must register it (e.g. at import of the plugin).

    Raises:
        ValueError: ``name`` is "auto" or already registered.
    """
    if name == "auto" or name in _MODULES:
        raise ValueError(f"transport {name!r} is already registered ({_MODULES.get(name, 'reserved')})")
    _MODULES[name] = (module, sender, receiver)


def names() -> list[str]:
    return sorted(_MODULES)


def _load(name: str, which: int) -> type:
    try:
        module, *classes = _MODULES[name]
    except KeyError:
        raise ValueError(f"unknown transport {name!r}; known: {', '.join(names())}") from None
    return getattr(importlib.import_module(module), classes[which])


def sender_class(name: str) -> type[SenderTransport]:
    return _load(name, 0)


def receiver_class(name: str) -> type[ReceiverTransport]:
    return _load(name, 1)


__all__ = ["ReceiverTransport", "SenderTransport", "TransportContext", "names", "receiver_class",
           "register_transport", "sender_class"]
