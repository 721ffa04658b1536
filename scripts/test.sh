#!/usr/bin/env bash
# The test suite on a fresh machine: set-up (venv, pinned torch, weightsync + dev + verl extras),
# the documentation build (--strict: a broken link or a stale API reference fails), then pytest.
# Extra arguments go to pytest (e.g. scripts/test.sh -m cuda).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev,verl
. .venv/bin/activate
site="$(mktemp -d)"
trap 'rm -rf "$site"' EXIT
NO_MKDOCS_2_WARNING=1 mkdocs build --strict --quiet --site-dir "$site"
python -m pytest "$@"
