"""The transports: one folder each, declaring its name, its sender and receiver classes and its rules
for ``auto`` (:mod:`.catalog`), chosen and built by name (:mod:`.selection`).
``SyncConfig(transport=...)`` accepts exactly the declared names (and "auto"), so a transport a
plugin registers can be selected. This package is the public interface a plugin implements (the
modules under it are internal): it only re-exports."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .. import _lazy
from . import catalog
from .catalog import Facts, Rank, Transport, names

if TYPE_CHECKING:
    from .base import ReceiverTransport, SenderTransport, SessionRecord, TransportContext, VersionRecord
    from .selection import receiver_class, sender_class

# Loaded on first use: a config names its transport through the catalog above, and a process that
# only checks a config (the coordinator's) needs neither torch nor the transports' code.
_LAZY = {"ReceiverTransport": ".base", "SenderTransport": ".base", "SessionRecord": ".base",
         "TransportContext": ".base", "VersionRecord": ".base", "receiver_class": ".selection",
         "sender_class": ".selection"}

__getattr__ = _lazy(__name__, _LAZY)


def register_transport(name: str, module: str, sender: str, receiver: str, **rules: Any) -> None:
    """Make a transport defined outside this package selectable; every party of a job must call it
    (e.g. when the plugin is imported). ``module`` (imported on first use) defines the ``sender``
    and ``receiver`` classes; ``rules``: ``refuses`` and ``auto``, as a folder's ``TRANSPORT``
    declares them (catalog.Transport). A transport inside the package is a folder with a
    ``TRANSPORT`` in its ``__init__.py`` instead.

    Raises:
        ValueError: ``name`` is "auto" or already registered.
    """
    catalog.register(Transport(name, module, sender, receiver, **rules))

__all__ = ["Facts", "Rank", "ReceiverTransport", "SenderTransport", "SessionRecord", "Transport", "TransportContext",
           "VersionRecord", "names", "receiver_class", "register_transport", "sender_class"]
