"""The transports: each one module (or folder) with a sender and a receiver class, chosen and
built by name (:mod:`.selection`) from the table of registered transports in
:mod:`weightsync.config`. ``SyncConfig(transport=...)`` accepts exactly the registered names
(and "auto"), so a transport registered by a plugin can be selected. This package is the
public interface a plugin implements (the modules under it are internal): it only re-exports."""

from __future__ import annotations

from ..config import register_transport
from ..config import transport_names as names
from .base import ReceiverTransport, SenderTransport, SessionRecord, TransportContext, VersionRecord
from .selection import receiver_class, sender_class

__all__ = ["ReceiverTransport", "SenderTransport", "SessionRecord", "TransportContext", "VersionRecord", "names",
           "receiver_class", "register_transport", "sender_class"]
