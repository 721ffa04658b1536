"""Internal. The one-step-off staleness bound, as a pure function."""

from __future__ import annotations

from ..errors import StalenessError


def check_staleness(batch_version: int | None, step: int, max_staleness: int) -> int:
    """Return the lag ``step - batch_version``; raise when it exceeds ``max_staleness``.

    A rollout batch generated with weights of version v may train step s only if
    s - v <= max_staleness (1 for one-step-off-policy). A batch with no version was made
    by a worker that served no complete weights, which is never acceptable.

    Args:
        batch_version: The weight version the batch was generated with (None: none served).
        step: The training step that would consume the batch.
        max_staleness: The largest lag allowed (1 for one-step-off, 0 for on-policy).

    Returns:
        The lag ``step - batch_version``.

    Raises:
        StalenessError: The batch has no version, is newer than the step, or is more than
            ``max_staleness`` versions old.
    """
    if batch_version is None:
        raise StalenessError(f"step {step}: the rollout batch carries no weight version (its worker served none)")
    lag = step - batch_version
    if lag < 0:
        raise StalenessError(f"step {step}: batch made with version {batch_version}, newer than the step itself")
    if lag > max_staleness:
        raise StalenessError(
            f"step {step}: batch made with weight version {batch_version} is {lag} versions old, "
            f"over the bound max_staleness={max_staleness}"
        )
    return lag
