"""The tier runs the vLLM it is named after: scripts/tiers/vllm*.sh say which one
(--vllm-release), and a venv built for another would pass every other test silently."""

from __future__ import annotations

from importlib.metadata import version

import pytest


def test_the_tier_runs_the_vllm_release_it_names(request):
    expected = request.config.getoption("--vllm-release")
    if not expected:
        pytest.skip("run through scripts/tiers/vllm*.sh, which name the release")
    # the empty-target build reports e.g. 0.10.1+empty
    assert version("vllm").split("+")[0] == expected
