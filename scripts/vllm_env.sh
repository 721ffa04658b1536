#!/usr/bin/env bash
# Creates .venv-vllm for the vllm test tier: torch==2.13.0 (CPU), vLLM 0.11.0 built from its
# source distribution with VLLM_TARGET_DEVICE=empty (how Ascend users install it: no kernels,
# the real Python model code), transformers<5, and weightsync (editable) with its dev extra.
# A venv of its own because vLLM's pins differ from the verl extra's.
#
# WSTEST_VLLM_VERSION picks the vLLM release (default 0.11.0): 0.10.1 is the one inside the
# official Ascend verl image (vLLM commit 38217877aa); its venv is .venv-vllm-0.10.1.
#
# Idempotent (scripts/lib/venv.sh): a stamp records what was installed; when it matches, this
# returns in about a second. Prints the venv's python on its last line.
#
# Why not `pip install vllm==0.11.0`: with VLLM_TARGET_DEVICE=empty the build reports version
# 0.11.0+empty, which pip refuses for a `==0.11.0` request; so the sdist is installed by
# direct reference: its URL on the index pip is configured with (scripts/sdist_url.py), the
# sha256 pinned here and checked by pip. Why --no-build-isolation: vLLM's
# build-system pins torch==2.8.0, which an isolated build would download (CUDA, GBs); the
# empty target compiles nothing and only needs torch importable and setuptools-scm.
# Why transformers<5: transformers 5 moved rope_theta and vLLM 0.11 then silently uses the
# wrong RoPE base.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/env.sh
version="${WSTEST_VLLM_VERSION:-0.11.0}"
case "$version" in  # the sdists' sha256 on PyPI, pinned
    0.11.0) vllm_sha="f435a64c24e9c4178d657a76f8edd8548ddc444012f7d06a9f79ac3a6392bfae"; default_venv=.venv-vllm ;;
    0.10.1) vllm_sha="99d00498f25b94767bb2696e88feb67730677dae605c9b8af99492dc3c34492d"; default_venv=.venv-vllm-0.10.1 ;;
    *) echo "vllm_env.sh: no pinned sdist for vLLM $version (0.11.0, 0.10.1)" >&2; exit 2 ;;
esac
venv="${WSTEST_VLLM_VENV:-$default_venv}"
torch_spec="${WSTEST_TORCH:-torch==2.13.0}"
. scripts/lib/venv.sh
stamp_key="vllm=${version} sha=${vllm_sha} torch=${torch_spec} pyproject=$(pyproject_hash)"
stamp="$venv/.weightsync-vllm-stamp"
venv_reuse "$venv" "$stamp" "$stamp_key"

venv_start "$venv"
constraints="$venv/constraints.txt"
printf '%s\ntransformers<5\n' "$torch_spec" > "$constraints"
$pip_q -c "$constraints" "$torch_spec"
$pip_q -c "$constraints" "setuptools>=77.0.3,<80" "setuptools-scm>=8" wheel packaging jinja2
vllm_url=$(python scripts/sdist_url.py "vllm-${version}.tar.gz" "$vllm_sha")
VLLM_TARGET_DEVICE=empty $pip_q -c "$constraints" --no-build-isolation "vllm @ ${vllm_url}#sha256=${vllm_sha}"
$pip_q -c "$constraints" -e ".[dev]"
python -c "import vllm, torch, transformers, weightsync; print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)" >&2
venv_done "$venv" "$stamp" "$stamp_key"
