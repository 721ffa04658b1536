#!/usr/bin/env bash
# Tier "vllm": real vLLM 0.11.0 model code (VLLM_TARGET_DEVICE=empty), in .venv-vllm.
# Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/../.."
. scripts/lib/env.sh
# not exported: every WEIGHTSYNC_* variable in the tests' environment is read as a config key
vpython=$(WSTEST_VLLM_VERSION=0.11.0 bash scripts/vllm_env.sh | tail -n 1)
[ "${1:-}" = "--prepare" ] && exit 0
"$vpython" -m pytest tests/vllm_tier --vllm-release=0.11.0 "$@"
