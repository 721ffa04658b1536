"""Weight-version tags on rollout batches and the one-step-off staleness bound.

The version a batch was generated with is the one every rollout worker reported serving
after the sync that preceded the generation (the workers' answer, not the trainer's
intention). The bound itself is :func:`weightsync.check_staleness`; this module only
reads and writes the tag and keeps the trainer's bookkeeping.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from weightsync import Coordinator, StalenessError, check_staleness

TAG = "weight_version"


def stamp(batch: Any, version: int | None) -> Any:
    """Tag a DataProto (or anything with a ``meta_info`` dict, or a dict) with ``version``."""
    meta = getattr(batch, "meta_info", None)
    if isinstance(meta, dict):
        meta[TAG] = version
    elif isinstance(batch, dict):
        batch[TAG] = version
    else:
        raise TypeError(f"cannot tag a {type(batch).__name__}: it has no meta_info dict")
    return batch


def batch_version(batch: Any) -> int | None:
    meta = getattr(batch, "meta_info", None)
    if isinstance(meta, dict):
        return meta.get(TAG)
    if isinstance(batch, dict):
        return batch.get(TAG)
    return None


def stamp_all(result: Any, version: int | None) -> Any:
    """Tag every batch in a trainer's generation result (a batch, or a tuple holding some)."""
    items = result if isinstance(result, (tuple, list)) else (result,)
    for item in items:
        if isinstance(getattr(item, "meta_info", None), dict):
            stamp(item, version)
    return result


def agreed_version(served: Sequence[int | None], names: Sequence[str] | None = None) -> int:
    """The one version all rollout workers serve; an error naming the odd ones otherwise."""
    if served and all(v == served[0] for v in served) and served[0] is not None:
        return served[0]
    names = list(names) if names is not None else [f"rollout-{i}" for i in range(len(served))]
    detail = ", ".join(f"{n}={v}" for n, v in zip(names, served, strict=False))
    raise StalenessError(f"rollout workers serve different weight versions after a sync ({detail}); "
                         "a batch generated now would mix versions")


def next_version(step: int | None, last: int | None) -> int:
    """The version of the next sync: the trainer step when it moved on since the last sync,
    otherwise the next integer (verl syncs twice at some steps, e.g. after loading a
    checkpoint and again at the first step). Deterministic, so every rank agrees."""
    if isinstance(step, int) and (last is None or step > last):
        return step
    return 0 if last is None else last + 1


class VersionLedger:
    """Trainer-side record of the generations launched since the last sync.

    One-step-off: every batch launched before a sync is trained while (or right after) the
    next version goes out. At each sync of version v, every batch still on record must be
    within ``max_staleness`` of v; a skipped or failed sync shows up here as a lag > 1.
    """

    def __init__(self, max_staleness: int, coordinator: Coordinator | None = None):
        self.max_staleness = max_staleness
        self.coordinator = coordinator
        self.served: int | None = None  # what the rollout workers serve now
        self.pending: list[int | None] = []
        self.last_lag: int | None = None

    def launched(self) -> int | None:
        """A generation starts now, with the weights served now; returns that version."""
        self.pending.append(self.served)
        return self.served

    def check(self, version: int | None, step: int) -> int:
        if self.coordinator is not None and version is not None:
            lag = self.coordinator.check_batch(version, step, self.max_staleness)
        else:
            lag = check_staleness(version, step, self.max_staleness)
        self.last_lag = lag
        return lag

    def before_sync(self, version: int) -> None:
        """Check every batch on record against the version about to go out."""
        pending, self.pending = self.pending, []
        for v in pending:
            self.check(v, version)
