"""weightsync's ``vllm.general_plugins`` entry point (weightsync_vllm.plugin) as an install of
weightsync declares it. vLLM loads every plugin of that group in every process it starts and
does not catch what one raises, so on a vLLM without the weight-transfer API (0.11, the
vllm-ascend releases on it; or no vLLM at all, as in this venv) registering must do nothing.
Where vLLM has the API, tests/vllm_engine runs the backend for real."""

from __future__ import annotations

import importlib.metadata
import importlib.util

import pytest


def _has_weight_transfer_api() -> bool:
    try:
        return importlib.util.find_spec("vllm.distributed.weight_transfer") is not None
    except ImportError:  # no vllm, or no vllm.distributed
        return False


def test_the_entry_point_names_the_register_function():
    eps = [e for e in importlib.metadata.entry_points(group="vllm.general_plugins") if e.name == "weightsync"]
    assert [e.value for e in eps] == ["weightsync_vllm.plugin:register"], eps


@pytest.mark.skipif(_has_weight_transfer_api(), reason="this vLLM has the weight-transfer API (tests/vllm_engine)")
def test_registering_without_the_weight_transfer_api_is_a_no_op():
    eps = [e for e in importlib.metadata.entry_points(group="vllm.general_plugins") if e.name == "weightsync"]
    register = eps[0].load()
    register()  # raised ModuleNotFoundError before it returned early, which would stop vLLM 0.11
