#!/usr/bin/env bash
# Tier "hosts": the multi-node path on hosts that share nothing (benchmarks/weightsync_bench/hostnet.py: network
# namespaces on a bridge, each host with its own address, /dev/shm and /tmp, links limited with
# tc tbf both ways, a Ray node each): the cluster itself, then the host-level faults (a partition,
# a lost host, the coordinator's host cut off, a slow link). Needs root; elsewhere its tests skip
# and say why. No venv of its own: it runs in the main .venv. Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/../.."
. scripts/lib/env.sh
[ -x .venv/bin/python ] || bash scripts/setup.sh dev >&2
[ "${1:-}" = "--prepare" ] && exit 0  # runs in the main venv: nothing to build
.venv/bin/python -m pytest -m "hosts and not slow" tests/test_hosts.py "$@"
