"""Internal. The ipc transport: bucket buffers on the sender's device, shared by handle. Declared here
for the catalog (transports/catalog.py): chosen, it needs ipc on the sender's device and every
receiver on that device; ``auto`` takes it first wherever both hold on an accelerator."""

from __future__ import annotations

from ..catalog import REMOTE, SAME_NODE, Facts, Rank, Transport


def _refuses(f: Facts) -> str | None:
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


def _auto(f: Facts) -> Rank | None:
    if f.colocated and f.accelerator and f.ipc.ok:
        return 0, f"auto: every receiver shares the sender's device ({f.on_device}); {f.ipc.reason}"
    return None


TRANSPORT = Transport("ipc", "weightsync.transports.ipc.transport", "IpcSender", "IpcReceiver", _refuses, _auto)
