#!/usr/bin/env bash
# Tier "bench": `weightsync bench` end to end (rows, baselines, growth, A/B against HEAD, delta
# rows, Ctrl-C, the quick preset) on the tiny layout; its pure parts (rounds, statistics) stay in
# the main suite. No venv of its own: it runs in the main .venv. Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/../.."
. scripts/lib/env.sh
[ -x .venv/bin/python ] || bash scripts/setup.sh dev >&2
[ "${1:-}" = "--prepare" ] && exit 0  # runs in the main venv: nothing to build
.venv/bin/python -m pytest -m bench tests/test_bench.py tests/test_bench_delta.py tests/test_bench_extra.py \
    tests/test_bench_quick.py tests/test_bench_ranks.py "$@"
