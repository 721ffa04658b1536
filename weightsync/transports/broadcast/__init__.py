"""Internal. The broadcast transport: a collective broadcast from sender rank 0 to every receiver.
Declared here for the catalog (transports/catalog.py): chosen over a device collective, it needs
one device per rank; ``auto`` takes it for receivers on other devices or other nodes."""

from __future__ import annotations

from ...errors import ConfigError
from ..catalog import COLOCATED, REMOTE, SAME_NODE, Facts, Rank, Transport

_LATE = ("auto: no receiver registered when the session was published (pass expected_receivers to let auto "
         "see placement); broadcast works for any placement")


def _refuses(f: Facts) -> str | None:
    if not f.clash:
        return None
    return (f"transport 'broadcast' over the {f.device} collective needs one device per rank: {f.clash}; "
            f"use 'ipc' for parties on one device, or backend 'gloo'")


def _auto(f: Facts) -> Rank | None:
    if not f.where:
        return (1, _LATE) if f.accelerator else None
    if f.same_node:
        if f.colocated or not f.accelerator or f.clash:
            return None
        return 1, f"auto: {f.describe(SAME_NODE)} on this node use other devices; broadcast over the {f.device} collective"
    if f.clash:  # receivers on other nodes: nothing else reaches them
        raise ConfigError(f"auto: {f.describe(REMOTE)} on other nodes need broadcast, but {f.clash}; "
                          f"place each party of a node on its own device, or set backend 'gloo'")
    why = f"auto: {f.describe(REMOTE)} on other nodes ({f.far()}); broadcast"
    if any(w != REMOTE for w in f.where):
        why += (f" to every receiver, {f.describe(COLOCATED, SAME_NODE)} on the sender's node included "
                f"(shm within a node beside broadcast across nodes is not built yet)")
    return 1, why


TRANSPORT = Transport("broadcast", "weightsync.transports.broadcast.transport", "BroadcastSender",
                      "BroadcastReceiver", _refuses, _auto)
