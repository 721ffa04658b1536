"""Drives the collective broadcast baselines of :mod:`weightsync.bench.collective` (written
separately) from the benchmark's actors; every baseline row says why when it cannot run."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def _module():
    try:
        return importlib.import_module("weightsync.bench.collective"), None
    except ImportError as exc:
        return None, f"weightsync.bench.collective is not part of this build ({exc})"


def unavailable(kind: str, backend: str, device: str) -> str | None:
    mod, why = _module()
    if mod is None:
        return why
    return "the collective baselines' interface is not wired into the runner yet"


def run(bench: Any, kind: str, rollouts: list, backend: str, bucket_mb: float | None,
        tick: Callable[[], None]) -> tuple[list[float], dict[str, Any]]:
    raise NotImplementedError(kind)
