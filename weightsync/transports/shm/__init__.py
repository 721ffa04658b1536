"""Internal. The shm transport: whole versions in host segments, or a streaming ring when they do not
fit. Declared here for the catalog (transports/catalog.py): chosen, it needs every receiver on
the sender's node; ``auto`` takes it for weights in host memory on one node, and where a device's
parties cannot use ipc or a device collective."""

from __future__ import annotations

from ..catalog import REMOTE, SAME_NODE, Facts, Rank, Transport

_LATE = ("auto: no receiver registered when the session was published (pass expected_receivers to let auto "
         "see placement); shm serves any receiver on this node")


def _refuses(f: Facts) -> str | None:
    if f.same_node:
        return None
    return (f"transport 'shm' needs every receiver on the sender's node ({f.node}); {f.describe(REMOTE)} on "
            f"{f.far()} are not")


def _auto(f: Facts) -> Rank | None:
    if not f.where:
        return None if f.accelerator else (1, _LATE)
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


# its two modes (whole versions, a streaming ring) are chosen by these factories
TRANSPORT = Transport("shm", "weightsync.transports.shm.transport", "open_shm_sender", "open_shm_receiver", _refuses,
                      _auto)
