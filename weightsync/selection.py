"""Which transport a session uses: a pure function of the config and where parties run."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .errors import ConfigError


def choose_transport(requested: str, sender: dict[str, Any], receivers: Sequence[dict[str, Any]]) -> tuple[str, str]:
    """Return (transport, reason). ``sender`` / ``receivers`` carry each party's ``host``."""
    same_node = all(r.get("host") == sender.get("host") for r in receivers)
    if requested != "auto":
        if requested == "shm" and not same_node:
            far = sorted({r.get("host") for r in receivers if r.get("host") != sender.get("host")})
            raise ConfigError(f"transport 'shm' needs every receiver on the sender's node; receivers on {far} are not")
        return requested, f"transport '{requested}' requested by config"
    if same_node:
        return "shm", "auto: every receiver shares the sender's node; shared memory works whatever the device"
    raise ConfigError("auto: receivers on other nodes need the broadcast transport, which is not available")
