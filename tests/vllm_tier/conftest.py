"""The vllm tiers: real vLLM model code, 0.11.0 (tier "vllm") and 0.10.1, the Ascend verl
image's (tier "vllm-0.10"); scripts/vllm_env.sh builds their venvs and the README's test
command runs both. Skipped where vLLM is not installed (the main venv)."""

from __future__ import annotations

import importlib.util

import pytest


def _missing(module: str) -> bool:
    # a submodule: a folder named vllm on sys.path would pass for the package itself
    try:
        return importlib.util.find_spec(module) is None
    except ModuleNotFoundError:
        return True


def pytest_addoption(parser):
    parser.addoption("--vllm-release", default=None,
                     help="the vLLM release this venv must hold (scripts/tiers/vllm*.sh pass it)")


def pytest_report_header(config):
    if _missing("vllm.model_executor"):
        return None
    from importlib.metadata import version

    return f"vllm tier: vLLM {version('vllm')}"


def pytest_collection_modifyitems(config, items):
    here = __file__.rsplit("/", 1)[0]
    missing = _missing("vllm.model_executor")
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.vllm)
            if missing:
                item.add_marker(pytest.mark.skip(reason="vLLM is not installed here (bash scripts/vllm_env.sh)"))
