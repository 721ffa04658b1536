"""What a trainer's logger gets from weightsync per version: numbers only (loggers such as
verl's tracking take floats), read from the coordinator's record of the version."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from weightsync.records import Metrics


def digest_metrics(version_record: Metrics) -> dict[str, float]:
    """Numeric digest metrics of one version (coordinator ``metrics(version)``) for trainer
    loggers: the low 32 bits of the sender's version digest (exact in a float; the full value
    is in status()) and whether every receiver reported the same."""
    sent = version_record.digest
    if not sent:
        return {}
    got = list(version_record.receiver_digests.values())
    return {"weightsync/digest": float(int(sent.rsplit(":", 1)[-1][-8:], 16)),
            "weightsync/digest_agree": float(bool(got) and all(d == sent for d in got))}
