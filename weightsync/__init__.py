"""weightsync: versioned trainer-to-rollout weight transfers over pluggable transports."""

from .config import SyncConfig
from .coordinator.client import Coordinator
from .coordinator.staleness import check_staleness
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
from .manifest import Manifest, TensorSpec, build_manifest
from .receiver import WeightReceiver
from .sender import StagedVersion, SyncResult, WeightSender

__version__ = "0.1.0"

__all__ = [
    "CapacityError", "ChecksumError", "ConfigError", "Coordinator", "DeadlineExceeded", "Manifest",
    "ManifestError", "ProtocolError", "StagedVersion", "StalenessError", "SyncConfig", "SyncFailed",
    "SyncResult", "TensorSpec", "VersionError", "WeightReceiver", "WeightSender", "WeightSyncError",
    "build_manifest", "check_staleness",
]
