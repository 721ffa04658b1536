"""The transports: the built-in ones in one list, :func:`register` for one from outside, and the
choice of one for a session (``transport: auto`` picks by where the parties are).

A transport is a :class:`~weightsync.transports.base.Transport` declaration: its name, how to
build its two ends, how to parse its records, and its rules for a placement. The built-in
transports' rules are the table below, as docs/design.md ("How auto chooses") gives it; a
plugin brings its own rules and calls :func:`register` in every party of a job (e.g. when it is
imported). ``SyncConfig(transport=...)`` accepts exactly the names listed here and "auto".

This module imports no torch (a config is checked where only the coordinator runs): each end is
built by a function that imports its module when a session picks it.
"""

from __future__ import annotations

import dataclasses
import importlib
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..errors import ConfigError
from ..records import SessionRecord, VersionRecord
from .base import (
    COLOCATED,
    REMOTE,
    SAME_NODE,
    Facts,
    Rank,
    ReceiverTransport,
    SenderTransport,
    Transport,
    TransportContext,
)
from .broadcast.records import BroadcastSession, BroadcastVersion
from .ipc.records import IpcSession, IpcVersion
from .shm.records import shm_session, shm_version

# -- the built-in transports' rules --------------------------------------------------------------

_LATE = "auto: no receiver registered when the session was published (pass expected_receivers to let auto see placement)"


def _shm_refuses(f: Facts) -> str | None:
    if f.same_node:
        return None
    return (f"transport 'shm' needs every receiver on the sender's node ({f.node}); {f.describe(REMOTE)} on "
            f"{f.far} are not")


def _shm_auto(f: Facts) -> Rank | None:
    if not f.where:
        return None if f.accelerator else (1, f"{_LATE}; shm serves any receiver on this node")
    if f.colocated and not f.accelerator:
        # host memory both ways: ipc would copy as much as shm (measured slower with 1 and 4
        # receivers on CPU), and shm keeps the previous version for rollback and catch-up
        return 1, ("auto: every receiver is on the sender's node and the weights live in host memory; shm "
                   "(keeps the previous version for rollback and catch-up)")
    if f.colocated:
        if f.ipc.ok:
            return None
        return 1, f"auto: every receiver shares the sender's device, but ipc is unavailable ({f.ipc.reason}); fell back to shm"
    if not f.same_node:
        return None
    if f.accelerator and f.clash:
        return 1, f"auto: {f.describe(SAME_NODE)} on this node use other devices, but {f.clash}: no device collective; shm"
    if not f.accelerator:
        return 1, "auto: every receiver is on the sender's node and there is no device collective; shm"
    return None


def _ipc_refuses(f: Facts) -> str | None:
    if not f.ipc.ok:
        return f"transport 'ipc' cannot run here: {f.ipc.reason}"
    if f.colocated:
        return None
    if not f.where:
        return ("transport 'ipc' needs its receivers registered before the first stage "
                "(pass expected_receivers to the sender) to check they share its device")
    kind = REMOTE if REMOTE in f.where else SAME_NODE
    return (f"transport 'ipc' needs every receiver on the sender's device ({f.node}, {f.on_device}); "
            f"{f.describe(kind)} {'run on another node' if kind == REMOTE else 'use another device'}")


def _ipc_auto(f: Facts) -> Rank | None:
    if f.colocated and f.accelerator and f.ipc.ok:
        return 0, f"auto: every receiver shares the sender's device ({f.on_device}); {f.ipc.reason}"
    return None


def _broadcast_refuses(f: Facts) -> str | None:
    if not f.clash:
        return None
    return (f"transport 'broadcast' over the {f.device} collective needs one device per rank: {f.clash}; "
            f"use 'ipc' for parties on one device, or backend 'gloo'")


def _broadcast_auto(f: Facts) -> Rank | None:
    if not f.where:
        return (1, f"{_LATE}; broadcast works for any placement") if f.accelerator else None
    if f.same_node:
        if f.colocated or not f.accelerator or f.clash:
            return None
        return 1, f"auto: {f.describe(SAME_NODE)} on this node use other devices; broadcast over the {f.device} collective"
    if f.clash:  # receivers on other nodes: nothing else reaches them
        raise ConfigError(f"auto: {f.describe(REMOTE)} on other nodes need broadcast, but {f.clash}; "
                          f"place each party of a node on its own device, or set backend 'gloo'")
    why = f"auto: {f.describe(REMOTE)} on other nodes ({f.far}); broadcast"
    if any(w != REMOTE for w in f.where):
        why += (f" to every receiver, {f.describe(COLOCATED, SAME_NODE)} on the sender's node included "
                f"(shm within a node beside broadcast across nodes is not built yet)")
    return 1, why


# -- how each end is built: its module is imported when a session picks it -----------------------


def _shm_sender(ctx: TransportContext) -> SenderTransport:
    from .shm.transport import open_sender

    return open_sender(ctx)


def _shm_receiver(ctx: TransportContext, session: SessionRecord) -> ReceiverTransport:
    from .shm.transport import open_receiver

    return open_receiver(ctx, session)


def _ipc_sender(ctx: TransportContext) -> SenderTransport:
    from .ipc.transport import IpcSender

    return IpcSender(ctx)


def _ipc_receiver(ctx: TransportContext, session: SessionRecord) -> ReceiverTransport:
    from .ipc.transport import IpcReceiver

    return IpcReceiver(ctx, session)


def _broadcast_sender(ctx: TransportContext) -> SenderTransport:
    from .broadcast.transport import BroadcastSender

    return BroadcastSender(ctx)


def _broadcast_receiver(ctx: TransportContext, session: SessionRecord) -> ReceiverTransport:
    from .broadcast.transport import BroadcastReceiver

    return BroadcastReceiver(ctx, session)


BUILTIN = (
    Transport("broadcast", _broadcast_sender, _broadcast_receiver, BroadcastSession.from_wire,
              BroadcastVersion.from_wire, _broadcast_refuses, _broadcast_auto),
    Transport("ipc", _ipc_sender, _ipc_receiver, IpcSession.from_wire, IpcVersion.from_wire, _ipc_refuses, _ipc_auto),
    # whole versions in segments, or a streaming ring when they exceed the budget: the records say which
    Transport("shm", _shm_sender, _shm_receiver, shm_session, shm_version, _shm_refuses, _shm_auto),
)

_known: dict[str, Transport] = {t.name: t for t in BUILTIN}
_lock = threading.Lock()


def register(transport: Transport) -> None:
    """Make a transport declared outside this package selectable (every party of a job must).

    Raises:
        ValueError: its name is "auto" or taken.
    """
    with _lock:
        if transport.name == "auto" or transport.name in _known:
            raise ValueError(f"transport {transport.name!r} is already registered")
        _known[transport.name] = transport


def forget(name: str) -> None:
    """Undo :func:`register` (the built-in transports stay)."""
    with _lock:
        if name not in {t.name for t in BUILTIN}:
            _known.pop(name, None)


def names() -> list[str]:
    """Every transport's name, sorted ("auto" is not one)."""
    return sorted(_known)


def get(name: str) -> Transport:
    """The transport ``name``.

    Raises:
        ValueError: none of that name.
    """
    known = _known.get(name)
    if known is None:
        raise ValueError(f"no transport named {name!r}; registered: {', '.join(names())}")
    return known


# -- the choice ---------------------------------------------------------------------------------


def _is_accelerator(kind: str) -> bool:
    """Whether ``kind`` is a device with memory of its own (not the host)."""
    return kind != "cpu"


def node_key(party: Any) -> str | None:
    """What identifies a party's node: its Ray node id, else (no Ray) its host address."""
    return party.node_id or party.host


def on_one_node(a: Any, b: Any) -> bool:
    """Two parties share a node (its /dev/shm, its devices) when their Ray node ids are equal;
    the host address decides only where a party has no node id (no Ray): several raylets on one
    machine, or nodes behind one address, are distinct nodes."""
    if a.node_id and b.node_id:
        return a.node_id == b.node_id
    return a.host == b.host


def node_label(party: Any) -> str:
    """A node as people read it: address and short Ray node id (simulated nodes share an address)."""
    node = party.node_id
    return f"{party.host} (node {node[:8]})" if node else str(party.host)


def _device(party: Any) -> Any:
    return party.device if party.device is not None else _HOST


@dataclasses.dataclass(frozen=True)
class _Host:
    type: str = "cpu"
    index: int | None = None
    physical: int | None = None


_HOST = _Host()


def placement(sender: Any, receiver: Any) -> str:
    """Where ``receiver`` runs relative to ``sender``: COLOCATED, SAME_NODE or REMOTE."""
    if not on_one_node(sender, receiver):
        return REMOTE
    sd, rd = _device(sender), _device(receiver)
    if sd.type != rd.type:
        return SAME_NODE
    if not _is_accelerator(sd.type):
        return COLOCATED  # host memory: one node is one "device"
    return COLOCATED if sd.physical is not None and sd.physical == rd.physical else SAME_NODE


def shared_device(sender: Any, receivers: Sequence[Any]) -> str | None:
    """Two parties on one physical accelerator, or None. A device collective (NCCL, HCCL)
    cannot hold one device twice: NCCL stops with "Duplicate GPU detected" or hangs."""
    seen: dict[tuple, str] = {}
    for who, party in [("the sender", sender)] + [(f"receiver '{r.name or r.rank}'", r) for r in receivers]:
        dev = _device(party)
        if not _is_accelerator(dev.type) or dev.physical is None:
            continue
        key = (node_key(party), dev.type, dev.physical)
        if key in seen:
            return f"{seen[key]} and {who} share physical {dev.type} {dev.physical} on {node_label(party)}"
        seen[key] = who
    return None


def facts(sender: Any, receivers: Sequence[Any], backend: str = "auto", shm_dir: str = "/dev/shm") -> Facts:
    """Where the parties are (``records.Placement`` each), as the rules read them. The sender's
    ipc support is its placement's where given, else probed on first use (ipc/support.py)."""
    where = [placement(sender, r) for r in receivers]
    dev = _device(sender)

    def probe_ipc() -> Any:
        if sender.ipc is not None:
            return sender.ipc
        from .ipc.support import ipc_support

        return ipc_support(dev.type, shm_dir)

    far = ", ".join(sorted({node_label(r) for r, w in zip(receivers, where) if w == REMOTE}))
    return Facts(sender=sender, receivers=receivers, where=where, device=dev.type,
                 on_device=f"physical {dev.type} {dev.physical}" if _is_accelerator(dev.type) else "host",
                 node=node_label(sender), far=far,
                 clash=shared_device(sender, receivers) if backend != "gloo" else None, probe_ipc=probe_ipc)


def choose(requested: str, sender: Any, receivers: Sequence[Any], backend: str = "auto",
           shm_dir: str = "/dev/shm") -> tuple[str, str]:
    """(transport, reason) for a session. An explicit choice that cannot work raises ConfigError
    with the reason its rules give; ``auto`` takes the transport whose rule ranks first for this
    placement and says why. ``backend`` is the broadcast backend of the config (gloo may share a
    device)."""
    f = facts(sender, receivers, backend, shm_dir)
    if requested != "auto":
        why = get(requested).refuses(f)
        if why:
            raise ConfigError(why)
        return requested, f"transport '{requested}' requested by config"
    ranked = sorted((r[0], t.name, r[1]) for t in list(_known.values()) if (r := t.auto(f)) is not None)
    if not ranked:
        raise ConfigError(f"auto: no transport serves this placement ({', '.join(f.where) or 'no receivers'})")
    return ranked[0][1], ranked[0][2]


# -- deprecated: the string-wired registration of earlier releases ------------------------------


def register_transport(name: str, module: str, sender: str, receiver: str, **rules: Any) -> None:
    """Deprecated (one release): ``register(Transport(...))`` with the ends themselves. ``module``,
    a module the caller names, defines the ``sender`` and ``receiver`` classes (a receiver taking
    the session record's wire form, as before)."""
    warnings.warn("weightsync.transports.register_transport is deprecated; use "
                  "register(Transport(name, sender, receiver, ...))", DeprecationWarning, stacklevel=2)

    def build_sender(ctx: TransportContext) -> SenderTransport:
        return getattr(importlib.import_module(module), sender)(ctx)

    def build_receiver(ctx: TransportContext, session: SessionRecord) -> ReceiverTransport:
        return getattr(importlib.import_module(module), receiver)(ctx, session)

    register(Transport(name, build_sender, build_receiver, **rules))


def sender_class(name: str) -> Callable[[TransportContext], SenderTransport]:
    """Deprecated (one release): ``get(name).sender``."""
    warnings.warn("weightsync.transports.sender_class is deprecated; use get(name).sender", DeprecationWarning,
                  stacklevel=2)
    return get(name).sender


def receiver_class(name: str) -> Callable[[TransportContext, Mapping[str, Any]], ReceiverTransport]:
    """Deprecated (one release): ``get(name).receiver``, which takes the parsed session record."""
    warnings.warn("weightsync.transports.receiver_class is deprecated; use get(name).receiver", DeprecationWarning,
                  stacklevel=2)
    t = get(name)
    return lambda ctx, wire: t.receiver(ctx, t.session(wire))


__all__ = ["BUILTIN", "Facts", "Rank", "ReceiverTransport", "SenderTransport", "SessionRecord", "Transport",
           "TransportContext", "VersionRecord", "choose", "get", "names", "register", "receiver_class",
           "register_transport", "sender_class"]
