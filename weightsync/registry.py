"""Which transports exist: name -> (module, sender, receiver): the classes, or factories
called with the same arguments.

A table with no imports of its own, so that the config (which accepts exactly these names)
and the transports package (which loads the classes) both read it without importing each
other. A transport's module is imported only when it is chosen, so its optional
dependencies (torch_npu, ...) are needed only then.
"""

from __future__ import annotations

_MODULES = {
    # shm's two modes (whole versions, a streaming ring) are chosen by these factories
    "shm": ("weightsync.transports.shm.transport", "open_shm_sender", "open_shm_receiver"),
    "broadcast": ("weightsync.transports.broadcast.transport", "BroadcastSender", "BroadcastReceiver"),
    "ipc": ("weightsync.transports.ipc.transport", "IpcSender", "IpcReceiver"),
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
    """The registered transport names, sorted ("auto" is not one)."""
    return sorted(_MODULES)


def entry(name: str) -> tuple[str, str, str]:
    """(module, sender class, receiver class) of ``name``.

    Raises:
        ValueError: no transport of that name is registered.
    """
    try:
        return _MODULES[name]
    except KeyError:
        raise ValueError(f"unknown transport {name!r}; known: {', '.join(names())}") from None
