"""Which transport a session uses: a pure function of the config and where parties run.

Each party is described by an ``ops.Placement``: ``node_id`` (its Ray node id), ``host`` (node
address), ``device`` (type, index, physical), and for the sender ``ipc`` (can this process
share device buckets by handle; ``capabilities.Capability``).
Two parties share a node (its /dev/shm, its devices) when their Ray node ids are equal; the
host address decides only where a party has no node id (no Ray): several raylets on one
machine, or nodes behind one address, are distinct nodes with distinct /dev/shm views.

The chain for ``auto``, best first:
  every receiver on the sender's device (same host, same physical accelerator)
      -> ipc  when the sender's platform supports it, else shm
  every receiver on the sender's node, weights in host memory (CPU)
      -> shm
  every receiver on the sender's node, on other devices
      -> broadcast over the device collective (hccl / nccl); shm on CPU-only nodes
  any receiver on another node
      -> broadcast, to every receiver (shm within the sender's node beside a broadcast
         across nodes is not built: receivers on the sender's node join the broadcast)
"""

from __future__ import annotations

from collections.abc import Sequence

from ..coordinator.ops import Device, IpcSupport, Placement
from ..errors import ConfigError

COLOCATED, SAME_NODE, REMOTE = "colocated", "same node", "remote"
ACCELERATORS = ("cuda", "npu", "sim")  # sim: the tests' simulated accelerator (weightsync/sim)


HOST = Device(type="cpu")


def node_key(party: Placement) -> str | None:
    """What identifies a party's node: its Ray node id, else (no Ray) its host address."""
    return party.node_id or party.host


def on_one_node(a: Placement, b: Placement) -> bool:
    if a.node_id and b.node_id:
        return a.node_id == b.node_id
    return a.host == b.host


def node_label(party: Placement) -> str:
    """A node as people read it: address and short Ray node id (simulated nodes share an address)."""
    node = party.node_id
    return f"{party.host} (node {node[:8]})" if node else str(party.host)


def placement(sender: Placement, receiver: Placement) -> str:
    """Where ``receiver`` runs relative to ``sender``: COLOCATED, SAME_NODE or REMOTE."""
    if not on_one_node(sender, receiver):
        return REMOTE
    sd, rd = sender.device or HOST, receiver.device or HOST
    kind = sd.type
    if kind != rd.type:
        return SAME_NODE
    if kind not in ACCELERATORS:
        return COLOCATED  # host memory: one node is one "device"
    mine, theirs = sd.physical, rd.physical
    return COLOCATED if mine is not None and mine == theirs else SAME_NODE


def _describe(receivers: Sequence[Placement], where: list[str], *kinds: str) -> str:
    names = [r.name or f"rank {r.rank}" for r, w in zip(receivers, where) if w in kinds]
    shown = ", ".join(str(n) for n in names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return f"{len(names)} receiver(s) ({shown})"


def _far(receivers: Sequence[Placement], where: list[str]) -> str:
    return ", ".join(sorted({node_label(r) for r, w in zip(receivers, where) if w == REMOTE}))


def shared_device(sender: Placement, receivers: Sequence[Placement]) -> str | None:
    """Two parties on one physical accelerator, or None. A device collective (NCCL, HCCL)
    cannot hold one device twice: NCCL stops with "Duplicate GPU detected" or hangs."""
    seen: dict[tuple, str] = {}
    for who, party in [("the sender", sender)] + [(f"receiver '{r.name or r.rank}'", r) for r in receivers]:
        dev = party.device or HOST
        if dev.type not in ACCELERATORS or dev.physical is None:
            continue
        key = (node_key(party), dev.type, dev.physical)
        if key in seen:
            return f"{seen[key]} and {who} share physical {dev.type} {dev.physical} on {node_label(party)}"
        seen[key] = who
    return None


def choose_transport(requested: str, sender: Placement, receivers: Sequence[Placement],
                     backend: str = "auto") -> tuple[str, str]:
    """Return (transport, reason). An explicit choice that cannot work raises ConfigError
    with the reason; ``auto`` walks the chain above and says why it stopped where it did.
    ``backend`` is the broadcast backend of the config (gloo may share a device)."""
    where = [placement(sender, r) for r in receivers]
    clash = shared_device(sender, receivers) if backend != "gloo" else None
    device = (sender.device or HOST).type
    ipc = sender.ipc or IpcSupport(ok=False, reason="the sender did not report ipc support")
    on_device = f"physical {device} {(sender.device or HOST).physical}" if device in ACCELERATORS else "host"
    colocated = bool(where) and all(w == COLOCATED for w in where)
    same_node = all(w != REMOTE for w in where)

    if requested != "auto":
        if requested == "ipc":
            if not ipc.ok:
                raise ConfigError(f"transport 'ipc' cannot run here: {ipc.reason}")
            if not colocated:
                if not where:
                    raise ConfigError("transport 'ipc' needs its receivers registered before the first stage "
                                      "(pass expected_receivers to the sender) to check they share its device")
                kind = REMOTE if REMOTE in where else SAME_NODE
                raise ConfigError(
                    f"transport 'ipc' needs every receiver on the sender's device ({node_label(sender)}, "
                    f"{on_device}); {_describe(receivers, where, kind)} "
                    f"{'run on another node' if kind == REMOTE else 'use another device'}"
                )
        if requested == "broadcast" and clash:
            raise ConfigError(f"transport 'broadcast' over the {device} collective needs one device per rank: {clash}; "
                              f"use 'ipc' for parties on one device, or backend 'gloo'")
        if requested == "shm" and not same_node:
            raise ConfigError(f"transport 'shm' needs every receiver on the sender's node ({node_label(sender)}); "
                              f"{_describe(receivers, where, REMOTE)} on {_far(receivers, where)} are not")
        return requested, f"transport '{requested}' requested by config"

    if not where:
        # nothing to place: pick what also serves receivers that register later
        if device in ACCELERATORS:
            return "broadcast", ("auto: no receiver registered when the session was published (pass "
                                 "expected_receivers to let auto see placement); broadcast works for any placement")
        return "shm", ("auto: no receiver registered when the session was published (pass expected_receivers "
                       "to let auto see placement); shm serves any receiver on this node")
    if colocated and device not in ACCELERATORS:
        # host memory both ways: ipc would copy as much as shm (measured slower with 1 and 4
        # receivers on CPU), and shm keeps the previous version for rollback and catch-up
        return "shm", ("auto: every receiver is on the sender's node and the weights live in host memory; shm "
                       "(keeps the previous version for rollback and catch-up)")
    if colocated:
        if ipc.ok:
            return "ipc", f"auto: every receiver shares the sender's device ({on_device}); {ipc.reason}"
        return "shm", (f"auto: every receiver shares the sender's device, but ipc is unavailable "
                       f"({ipc.reason}); fell back to shm")
    if same_node:
        split = _describe(receivers, where, SAME_NODE)
        if device in ACCELERATORS and clash:
            return "shm", f"auto: {split} on this node use other devices, but {clash}: no device collective; shm"
        if device in ACCELERATORS:
            return "broadcast", f"auto: {split} on this node use other devices; broadcast over the {device} collective"
        return "shm", "auto: every receiver is on the sender's node and there is no device collective; shm"
    if clash:
        raise ConfigError(f"auto: {_describe(receivers, where, REMOTE)} on other nodes need broadcast, but {clash}; "
                          f"place each party of a node on its own device, or set backend 'gloo'")
    why = f"auto: {_describe(receivers, where, REMOTE)} on other nodes ({_far(receivers, where)}); broadcast"
    if any(w != REMOTE for w in where):
        why += (f" to every receiver, {_describe(receivers, where, COLOCATED, SAME_NODE)} on the sender's node included "
                f"(shm within a node beside broadcast across nodes is not built yet)")
    return "broadcast", why
