"""Internal. What every module that makes benchmark rows shares (runner, rdt_rows, baseline_rows): the
row deadline, the text of a remote error, and whether a device collective has its devices.
Its own module so that the row modules need not import the runner that calls them."""

from __future__ import annotations

import re

import ray

from weightsync.device import ray_resource

# generous: a row on a loaded 2-core machine can be slow, but never hangs the benchmark
ROW_TIMEOUT_S = 600.0


def describe_error(exc: BaseException) -> str:
    """The remote exception's own type and message, not Ray's wrapper header."""
    cause = getattr(exc, "cause", None)
    if isinstance(exc, ray.exceptions.RayTaskError) and cause is not None:
        exc = cause
    text = re.sub(r"\x1b\[[0-9;]*m", "", f"{type(exc).__name__}: {exc}")
    return " ".join(text.split())[:600]


def one_device_per_rank(backend: str, device: str) -> bool:
    """A device collective cannot hold one device twice: its rows need a device per party."""
    return ray_resource(device) is not None and backend in ("nccl", "hccl")


def devices_short(device: str, backend: str, ranks: int) -> str | None:
    """Why ``ranks`` parties cannot each get a whole ``device`` now, or None."""
    free = ray.available_resources().get(ray_resource(device) or "", 0.0)
    if free >= ranks:
        return None
    return (f"backend {backend} needs one {device} device per rank ({ranks} ranks) and {int(free)} are free "
            f"in the Ray cluster (the colocated rows hold one); a communicator cannot hold one device twice")
