"""Transport classes by name (the table is in :mod:`weightsync.config`). Each transport is one
module exposing a sender and a receiver class; modules are imported on first use, so a
transport's optional dependencies (torch_npu, ...) are needed only when it is chosen.
``SyncConfig(transport=...)`` accepts exactly the registered names (and "auto"), so a
transport registered by a plugin can be selected."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

from ..config import register_transport
from ..config import transport_entry as entry
from ..config import transport_names as names
from .base import ReceiverTransport, SenderTransport, TransportContext


def _load(name: str, which: int) -> Any:
    module, *classes = entry(name)
    return getattr(importlib.import_module(module), classes[which])


def sender_class(name: str) -> Callable[[TransportContext], SenderTransport]:
    """What builds the sender of ``name`` from a TransportContext (a class or a factory)."""
    return _load(name, 0)


def receiver_class(name: str) -> Callable[[TransportContext, Mapping[str, Any]], ReceiverTransport]:
    """What builds the receiver of ``name`` from a TransportContext and the wire form of the
    sender's session record (parsed there: transports/records.py)."""
    return _load(name, 1)


__all__ = ["ReceiverTransport", "SenderTransport", "TransportContext", "names", "receiver_class",
           "register_transport", "sender_class"]
