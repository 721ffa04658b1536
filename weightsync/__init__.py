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
from .targets import CopyInto

# The handle crosses processes by pickle (a driver hands it to its parties), and those may run
# another revision of this package (``weightsync bench --against REV``): it pickles under its
# public name, which stays put when the internal modules move.
Coordinator.__module__ = __name__

__version__ = "0.1.0"

__all__ = [
    "CapacityError", "ChecksumError", "ConfigError", "Coordinator", "CopyInto", "DeadlineExceeded", "Manifest",
    "ManifestError", "ProtocolError", "StagedVersion", "StalenessError", "SyncConfig", "SyncFailed",
    "SyncResult", "TensorSpec", "VersionError", "WeightReceiver", "WeightSender", "WeightSyncError",
    "build_manifest", "check_staleness",
]
