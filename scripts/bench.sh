#!/usr/bin/env bash
# The main job on a fresh machine: set-up, then the sync-throughput benchmark on CPU over the
# built-in Qwen2.5-0.5B layout (no download): the quick default (about 2.5 min on a shared
# 2-core VM). Extra arguments go to `weightsync bench`, e.g. --full for the thorough matrix.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/env.sh
bash scripts/setup.sh bench,plot
. .venv/bin/activate
mkdir -p results
exec weightsync bench --model qwen2.5-0.5b --device cpu --json results/bench.json --plot results/bench.png "$@"
