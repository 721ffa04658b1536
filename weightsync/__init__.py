"""weightsync: versioned trainer-to-rollout weight transfers over pluggable transports."""

from __future__ import annotations

import importlib
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
    from .sender import StagedVersion, SyncResult, WeightSender
    from .targets import CopyInto

# Loaded on first use: every process that unpickles the coordinator actor's class imports this
# package first, and the coordinator needs no torch (importing it is most of an actor's start).
_LAZY = {
    "SyncConfig": ".config", "Coordinator": ".coordinator.client", "check_staleness": ".coordinator.staleness",
    "Manifest": ".manifest", "TensorSpec": ".manifest", "build_manifest": ".manifest",
    "WeightReceiver": ".receiver", "StagedVersion": ".sender", "SyncResult": ".sender", "WeightSender": ".sender",
    "CopyInto": ".targets",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'weightsync' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__version__ = "0.1.0"

__all__ = [
    "CapacityError", "ChecksumError", "ConfigError", "Coordinator", "CopyInto", "DeadlineExceeded", "Manifest",
    "ManifestError", "ProtocolError", "StagedVersion", "StalenessError", "SyncConfig", "SyncFailed",
    "SyncResult", "TensorSpec", "VersionError", "WeightReceiver", "WeightSender", "WeightSyncError",
    "build_manifest", "check_staleness",
]
