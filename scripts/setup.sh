#!/usr/bin/env bash
# Creates .venv (if missing) and installs weightsync with the given extras.
# torch is installed first and pinned: an unpinned torch pulls a multi-GB CUDA build, and
# on these machines torch==2.13.0 is the local CPU wheel. Override with WEIGHTSYNC_TORCH
# (e.g. WEIGHTSYNC_TORCH=skip on a node whose torch / torch_npu stack is already installed).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/env.sh
extras="${1:-dev}"
python="${PYTHON:-python3}"
torch_spec="${WSTEST_TORCH:-torch==2.13.0}"
if [ ! -x .venv/bin/python ]; then
    if [ "$torch_spec" = "skip" ]; then
        # the node's own torch (CUDA build, or torch + torch_npu on Ascend) must stay visible
        "$python" -m venv --system-site-packages .venv
    else
        "$python" -m venv .venv
    fi
fi
. .venv/bin/activate
pip_q="pip install --quiet --disable-pip-version-check"
if [ "$torch_spec" != "skip" ]; then
    $pip_q "$torch_spec"
fi
$pip_q -e ".[${extras}]"
