#!/usr/bin/env bash
# The test suite on a fresh machine: set-up (venv, pinned torch, weightsync + dev + verl extras),
# then pytest. Extra arguments go to pytest (e.g. scripts/test.sh -m cuda).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev,verl
. .venv/bin/activate
exec python -m pytest "$@"
