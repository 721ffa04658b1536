"""weightsync: versioned trainer-to-rollout weight transfers over pluggable transports."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .errors import (
    CapacityError,
    ChecksumError,
    ConfigError,
    DeadlineExceeded,
    ManifestError,
    ProtocolError,
    StalenessError,
    SyncFailed,
    VersionError,
    WeightSyncError,
)

if TYPE_CHECKING:
    from .config import SyncConfig
    from .coordinator.client import Coordinator
    from .coordinator.staleness import check_staleness
    from .manifest import Manifest, TensorSpec, build_manifest
    from .receiver import WeightReceiver
    from .records import Metrics, PartyStatus, ReceiverMetrics, Status
    from .sender import StagedVersion, SyncResult, WeightSender
    from .targets import CopyInto

# Loaded on first use: every process that unpickles the coordinator actor's class imports this
# package first, and the coordinator needs no torch (importing it is most of an actor's start).
_LAZY = {
    "SyncConfig": ".config", "Coordinator": ".coordinator.client", "check_staleness": ".coordinator.staleness",
    "Manifest": ".manifest", "TensorSpec": ".manifest", "build_manifest": ".manifest",
    "WeightReceiver": ".receiver", "StagedVersion": ".sender", "SyncResult": ".sender", "WeightSender": ".sender",
    "CopyInto": ".targets", "Metrics": ".records", "PartyStatus": ".records", "ReceiverMetrics": ".records",
    "Status": ".records",
}


def _lazy(package: str, where: dict[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that imports each name of ``where`` from its module (relative to
    ``package``) on first use and keeps it."""

    def __getattr__(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(where[name], package), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__


__getattr__ = _lazy(__name__, _LAZY)


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__version__ = "0.1.0"

__all__ = [
    "CapacityError", "ChecksumError", "ConfigError", "Coordinator", "CopyInto", "DeadlineExceeded", "Manifest",
    "ManifestError", "Metrics", "PartyStatus", "ProtocolError", "ReceiverMetrics", "StagedVersion", "StalenessError",
    "Status", "SyncConfig", "SyncFailed", "SyncResult", "TensorSpec", "VersionError", "WeightReceiver", "WeightSender",
    "WeightSyncError", "build_manifest", "check_staleness",
]
