"""weightsync: versioned trainer-to-rollout weight transfers over pluggable transports."""

from __future__ import annotations

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


def __getattr__(name: str) -> Any:
    """The public names below, each imported on first use: every process that unpickles the
    coordinator actor's class imports this package first, and the coordinator needs no torch
    (importing it is most of an actor's start)."""
    if name == "SyncConfig":
        from .config import SyncConfig as value
    elif name == "Coordinator":
        from .coordinator.client import Coordinator as value
    elif name == "check_staleness":
        from .coordinator.staleness import check_staleness as value
    elif name in ("Manifest", "TensorSpec", "build_manifest"):
        from . import manifest

        value = getattr(manifest, name)
    elif name == "WeightReceiver":
        from .receiver import WeightReceiver as value
    elif name in ("StagedVersion", "SyncResult", "WeightSender"):
        from . import sender

        value = getattr(sender, name)
    elif name == "CopyInto":
        from .targets import CopyInto as value
    elif name in ("Metrics", "PartyStatus", "ReceiverMetrics", "Status"):
        from . import records

        value = getattr(records, name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__version__ = "0.1.0"

__all__ = [
    "CapacityError", "ChecksumError", "ConfigError", "Coordinator", "CopyInto", "DeadlineExceeded", "Manifest",
    "ManifestError", "Metrics", "PartyStatus", "ProtocolError", "ReceiverMetrics", "StagedVersion", "StalenessError",
    "Status", "SyncConfig", "SyncFailed", "SyncResult", "TensorSpec", "VersionError", "WeightReceiver", "WeightSender",
    "WeightSyncError", "build_manifest", "check_staleness",
]
