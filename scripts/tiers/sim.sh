#!/usr/bin/env bash
# Tier "sim": the branches only an accelerator takes (device buckets, events, device digests and
# handles, loads onto a device, a device collective's event polling), run on the simulated
# asynchronous accelerator of tests/sim/weightsync_sim: every transport, faults included, receive ahead on
# broadcast, and the ipc ring under 200 seeded event orders. No venv of its own: it runs in the
# main .venv.
# Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/../.."
. scripts/lib/env.sh
[ -x .venv/bin/python ] || bash scripts/setup.sh dev >&2
[ "${1:-}" = "--prepare" ] && exit 0  # runs in the main venv: nothing to build
# two workers, a file each, as the main suite: the sim tests wait on processes and simulated lags far
# more than they compute (the sim jobs' liveness bound, tests/support/parties.py, allows for it)
.venv/bin/python -m pytest -n 2 --dist loadfile -m sim tests/test_device.py tests/test_sim_ring.py tests/test_sim_faults.py tests/test_sim_receive_ahead.py tests/test_sim_shards.py "$@"
