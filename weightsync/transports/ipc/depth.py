"""How many bucket buffers a streaming transport keeps in flight: ipc's ring, shm's streaming
ring (at most; its budget may allow fewer) and broadcast's buffers per side.

Two is the default everywhere: one buffer being written while the other is read. The choice
is measured, per transport, on the 2-core VM (docs/benchmarks.md, "Ring depth");
``WEIGHTSYNC_RING_BUFFERS`` overrides it in every process that imports the transports, to
repeat that measurement (the benchmark's parties inherit it from the driver's environment).
"""

from __future__ import annotations

import os

from ...errors import ConfigError

ENV = "WEIGHTSYNC_RING_BUFFERS"
LIMIT = 8  # ipc_wire.MAX_BUFFERS: the control block's room


def in_flight(default: int) -> int:
    """``default``, or the override from the environment (1 .. LIMIT)."""
    raw = os.environ.get("WEIGHTSYNC_RING_BUFFERS", "")
    if not raw:
        return default
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if not 1 <= n <= LIMIT:
        raise ConfigError(f"{ENV}={raw!r}: buffers in flight must be an integer from 1 to {LIMIT}")
    return n
