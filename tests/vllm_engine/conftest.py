"""The vllm-engine tier: weightsync as vLLM's weight-transfer backend, in vLLM's real CPU
engine (vllm-cpu >= 0.32, the venv scripts/vllm_cpu_env.sh builds; scripts/tiers/vllm-engine.sh
runs it). Skipped where that engine, or its weight-transfer API, is not installed."""

from __future__ import annotations

import importlib.metadata
import importlib.util

import pytest


def _why_not() -> str | None:
    try:
        version = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return "vLLM is not installed here (bash scripts/vllm_cpu_env.sh 0.32.0)"
    if not version.endswith("+cpu"):  # the distribution vllm_cpu_env.sh writes selects CpuPlatform
        return f"vLLM {version} here is not the CPU engine (bash scripts/vllm_cpu_env.sh 0.32.0)"
    if importlib.util.find_spec("vllm.distributed.weight_transfer") is None:
        return f"vLLM {version} has no weight-transfer API (vllm.distributed.weight_transfer: vLLM >= 0.32)"
    return None


def pytest_collection_modifyitems(config, items):
    here = __file__.rsplit("/", 1)[0]
    why = _why_not()
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.vllm)
            if why is not None:
                item.add_marker(pytest.mark.skip(reason=why))
