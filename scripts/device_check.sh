#!/usr/bin/env bash
# One command on a GPU or NPU node: the device tests, the device digest's speed, then a short
# device benchmark, each step under a deadline, every log and the JSON in one folder. About 8
# minutes on one H100 (the tests 232 s of it, 2026-11-28).
#
#   bash scripts/device_check.sh [--device cuda|npu] [--out DIR] [--steps tests,digest,bench]
#
# It uses the node's own torch (CUDA build, or torch + torch_npu) and Ray. Where Ray is not
# installed (an offline node), the trimmed Ray that `bash ../shared/tools/gpu-kit.sh` packs into
# .gpu/ is unpacked and used. Deadlines: T_TESTS (300 s), T_DIGEST (60 s) and T_BENCH (240 s), in seconds;
# the bench starts no row after two thirds of T_BENCH, so it writes its JSON before the timeout.
# A shorter check (a lent device's minutes are few): K picks tests (pytest -k), ROUNDS and
# BASELINES override the bench's (2; "ray-numpy ray-rdt").
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/env.sh
kind="" out="" steps="tests,digest,bench"
while [ $# -gt 0 ]; do
    case "$1" in
        --device) kind="$2"; shift 2 ;;
        --out) out="$2"; shift 2 ;;
        --steps) steps="$2"; shift 2 ;;
        *) echo "device_check: unknown argument '$1' (--device cuda|npu, --out DIR, --steps tests,bench)" >&2; exit 2 ;;
    esac
done
py=python3
[ -x .venv/bin/python ] && py=.venv/bin/python
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$PWD/benchmarks:$PWD/integrations/verl:$PWD/integrations/vllm${PYTHONPATH:+:$PYTHONPATH}"
if ! "$py" -c "import ray" 2>/dev/null && [ -f .gpu/site.tar.xz ]; then
    site=/tmp/weightsync-gpu-site
    [ -d "$site/ray" ] || { mkdir -p "$site" && tar -xJf .gpu/site.tar.xz -C "$site"; }
    export PYTHONPATH="$site:$PYTHONPATH" PATH="$site/bin:$PATH"
fi
if [ -z "$kind" ]; then
    kind=$("$py" -c "from weightsync.device import platform; print(platform())" 2>/dev/null || echo cpu)
fi
if [ "$kind" != "cuda" ] && [ "$kind" != "npu" ]; then
    echo "device_check: no accelerator here (platform: $kind); nothing to check. On CPU the device branches run" \
         "on the simulated accelerator: bash scripts/tiers/sim.sh" >&2
    exit 2
fi
out="${out:-results/device-check-$(date -u +%Y%m%dT%H%M%SZ)}"
mkdir -p "$out"
{
    date -u; uname -a; nproc; free -g
    if [ "$kind" = "cuda" ]; then nvidia-smi; else npu-smi info; fi
    "$py" -c "import ray, torch; print('ray', ray.__version__, 'torch', torch.__version__)"
    "$py" -m weightsync.cli doctor
} > "$out/env.txt" 2>&1
rc=0
if [[ $steps == *tests* ]]; then
    # SIGINT at the deadline, not timeout's SIGTERM: ray.init makes SIGTERM a SystemExit in the
    # running test, which pytest records as that test's failure, and a second one (the process
    # group's) ends pytest before its summary. An interrupt gives the summary, "(interrupted)"
    timeout -s INT -k 30 "${T_TESTS:-300}" "$py" -m pytest -m "$kind" ${K:+-k "$K"} -p no:cacheprovider -rs \
        --timeout=90 -o faulthandler_timeout=80 tests > "$out/tests.log" 2>&1
    t=$?
    if [ $t -eq 124 ] || [ $t -eq 137 ]; then
        echo "device_check: the T_TESTS deadline (${T_TESTS:-300} s) stopped the tests; the one running then was" \
            "interrupted, not failed" | tee -a "$out/tests.log"
    fi
    echo "device_check: tests rc=$t (log: $out/tests.log)"; tail -5 "$out/tests.log"; [ $t -eq 0 ] || rc=1
fi
if [[ $steps == *digest* ]]; then
    timeout "${T_DIGEST:-60}" "$py" benchmarks/digest_device.py --device "$kind" --json "$out/digest.json" \
        > "$out/digest.log" 2>&1
    d=$?; echo "device_check: digest rc=$d (log: $out/digest.log)"; tail -12 "$out/digest.log"; [ $d -eq 0 ] || rc=1
fi
if [[ $steps == *bench* ]]; then
    plot=(); "$py" -c "import matplotlib" 2>/dev/null && plot=(--plot "$out/bench.png")
    timeout "${T_BENCH:-240}" "$py" -m weightsync.cli bench --device "$kind" --transport ipc shm --bucket-mb 256 \
        --receivers 1 4 --checksum on off --baselines ${BASELINES:-ray-numpy ray-rdt} --rounds "${ROUNDS:-2}" --versions 3 \
        --warmup 1 --no-progress \
        --fixed-cost --fixed-cost-receivers 1 \
        --deadline-s $(( ${T_BENCH:-240} * 2 / 3 )) \
        --note "scripts/device_check.sh" --json "$out/bench.json" "${plot[@]}" > "$out/bench.log" 2>&1
    b=$?; echo "device_check: bench rc=$b (log: $out/bench.log)"; tail -25 "$out/bench.log"; [ $b -eq 0 ] || rc=1
fi
echo "device_check: everything is in $out"
exit $rc
