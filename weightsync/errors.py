"""Errors a user can act on. Each names the party, tensor or key at fault."""

from __future__ import annotations


class WeightSyncError(RuntimeError):
    """Base class of every error weightsync raises on purpose."""


class ConfigError(WeightSyncError, ValueError):
    """A config key is unknown or its value is impossible; the message names the key."""


class ManifestError(WeightSyncError):
    """Tensors offered or expected do not match the agreed manifest; names the tensor."""


class ProtocolError(WeightSyncError):
    """A control message was malformed, or a party broke the version protocol."""


class SessionLost(ProtocolError):
    """The coordinator does not know this party (it was restarted): re-register."""


class VersionError(WeightSyncError):
    """A version went backwards, was reused, or was never staged."""


class ChecksumError(WeightSyncError):
    """Bucket bytes differ from what the sender wrote (corrupted or truncated in transit)."""


class DeadlineExceeded(WeightSyncError, TimeoutError):
    """A wait ran past its configured deadline; the message says what was awaited."""


class CapacityError(WeightSyncError):
    """Not enough space (shared memory, buffers) for what was asked; sizes in the message."""


class StalenessError(WeightSyncError):
    """A rollout batch is older than the configured staleness bound allows."""


class SyncFailed(WeightSyncError):
    """A version did not commit on every receiver.

    ``failed`` maps party name to the reason it failed; ``committed`` lists the
    receivers that do serve the version.

    Args:
        version: The version that failed.
        failed: Party name -> the reason it failed.
        committed: The receivers that committed the version anyway.
    """

    def __init__(self, version: int, failed: dict[str, str], committed: list[str] | None = None):
        self.version = version
        self.failed = dict(failed)
        self.committed = list(committed or [])
        who = "; ".join(f"{name}: {why}" for name, why in sorted(self.failed.items()))
        super().__init__(f"version {version} failed on {len(self.failed)} party(ies): {who}")

    def __reduce__(self):  # keep the fields when Ray re-raises it in another process
        return (SyncFailed, (self.version, self.failed, self.committed))
