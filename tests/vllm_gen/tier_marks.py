"""What the gen and vllm-engine tiers' conftests share: which vLLM CPU engine is installed, and
marking a tier's tests (vllm, and skipped with the reason where the engine is missing)."""

from __future__ import annotations

import importlib.metadata

import pytest


def cpu_engine_version() -> str | None:
    """vLLM's version where it is the CPU engine, else None."""
    try:
        version = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return None
    # the distribution scripts/vllm_cpu_wheel.py writes: "<version>+cpu" selects vLLM's CpuPlatform
    return version if version.endswith("+cpu") else None


def mark_tier(items: list, here: str, why_not: str | None) -> None:
    """Mark the tests under ``here`` as vllm, and skip them with ``why_not`` unless None."""
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.vllm)
            if why_not is not None:
                item.add_marker(pytest.mark.skip(reason=why_not))
