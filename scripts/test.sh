#!/usr/bin/env bash
# The test suite on a fresh machine: set-up (venv, pinned torch, weightsync + dev + verl extras),
# the documentation build (--strict: a broken link or a stale API reference fails), then pytest.
# Extra arguments go to pytest (e.g. scripts/test.sh -m cuda).
# Without arguments it then runs the vllm tier (tests/vllm_tier, real vLLM 0.11.0 model code) in
# its own venv, .venv-vllm (scripts/vllm_env.sh; vLLM's pins differ from the verl extra's);
# WEIGHTSYNC_VLLM_TIER=0 skips it, =1 runs it even with arguments.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev,verl
. .venv/bin/activate
site="$(mktemp -d)"
trap 'rm -rf "$site"' EXIT
NO_MKDOCS_2_WARNING=1 mkdocs build --strict --quiet --site-dir "$site"
tier="${WEIGHTSYNC_VLLM_TIER:-$([ $# -eq 0 ] && echo 1 || echo 0)}"
status=0
python -m pytest "$@" || status=$?
[ "$tier" = "1" ] || exit "$status"
deactivate
vpython=$(bash scripts/vllm_env.sh | tail -n 1)
rc=0
"$vpython" -m pytest tests/vllm_tier "$@" || rc=$?
[ "$rc" -eq 5 ] && rc=0  # every vllm test deselected by the arguments (e.g. -m cuda)
[ "$status" -ne 0 ] && exit "$status"
exit "$rc"
