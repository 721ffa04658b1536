#!/usr/bin/env bash
# Tier "vllm-0.10": the vllm tier's tests on real vLLM 0.10.1 model code (VLLM_TARGET_DEVICE=empty),
# the vLLM of the official Ascend verl image (commit 38217877aa), in .venv-vllm-0.10.1.
# Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/../.."
. scripts/lib/env.sh
# not exported: every WEIGHTSYNC_* variable in the tests' environment is read as a config key
vpython=$(WSTEST_VLLM_VERSION=0.10.1 bash scripts/vllm_env.sh | tail -n 1)
[ "${1:-}" = "--prepare" ] && exit 0
"$vpython" -m pytest tests/vllm_tier --vllm-release=0.10.1 "$@"
