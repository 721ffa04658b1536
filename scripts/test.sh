#!/usr/bin/env bash
# The test suite on a fresh machine: set-up (venv, pinned torch, weightsync + dev + verl extras),
# the documentation build (--strict, and a warning fails it), then pytest, then the tiers.
# Extra arguments go to pytest (e.g. scripts/test.sh -m cuda).
#
# Tiers: each scripts/tiers/<name>.sh builds a venv of its own (real third-party code whose pins
# differ from the main venv's: vLLM's model code, vLLM's CPU engine, ...) and runs its tests.
# Without arguments every tier runs; with arguments none, unless named. WEIGHTSYNC_TIERS picks
# them ("vllm gen", or "none"); WEIGHTSYNC_VLLM_TIER=0 still leaves out the vllm tiers (0.11.0, 0.10.1).
# `scripts/tiers/<name>.sh --prepare` only builds what the tier needs. About a third of a fresh run
# was those builds one after another; they now go on in the background, in the order the tiers
# run, while the tiers that need none (sim, bench, conformance, hosts first) run: a tier that reaches a venv
# still being built waits for it (scripts/lib/venv.sh holds one lock per venv).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/env.sh
bash scripts/setup.sh dev,verl
. .venv/bin/activate
site="$(mktemp -d)"
trap 'rm -rf "$site"' EXIT
# not --quiet: with it mkdocs counts no warnings, and --strict then never aborts
if ! NO_MKDOCS_2_WARNING=1 mkdocs build --strict --site-dir "$site" > "$site.log" 2>&1; then
    grep -v '^INFO' "$site.log" >&2; rm -f "$site.log"
    echo "docs build failed (mkdocs --strict: a warning is an error)" >&2; exit 1
fi
rm -f "$site.log"
status=0
# two pytest-xdist workers, a file each at a time (a module's job fixture starts once): the suite
# waits on processes and deadlines more than it computes, so two at once on 2 cores take about
# 470 s instead of 730 s. Each worker has its own Ray cluster and leak checks (tests/conftest.py);
# `-n 0` among the arguments runs it serially, as a plain `pytest` does. The tiers run serially.
python -m pytest -n 2 --dist loadfile "$@" || status=$?
deactivate

# those that run in the main venv first, so the others' venvs build meanwhile
first="sim bench conformance hosts"
all_tiers="$first $(cd scripts/tiers && ls ./*.sh | sed 's|^\./||; s|\.sh$||' | grep -vxF "${first// /$'\n'}" | sort | tr '\n' ' ')"
tiers="${WSTEST_TIERS:-$([ $# -eq 0 ] && echo "$all_tiers" || echo none)}"
[ "${WSTEST_VLLM_TIER:-}" = "0" ] && tiers=$(echo " $tiers " | sed 's/ vllm / /; s/ vllm-0.10 / /')
[ "${WSTEST_VLLM_TIER:-}" = "1" ] && [ "$tiers" = "none" ] && tiers=vllm
for tier in $tiers; do
    [ "$tier" = "none" ] || [ -f "scripts/tiers/$tier.sh" ] || { echo "no tier '$tier' (tiers: $all_tiers)" >&2; exit 2; }
done
prepare_log="$(mktemp)"
# a session of its own, so that leaving early (an error, Ctrl-C) stops every pip it started
setsid bash -c 'for t in "$@"; do [ "$t" = none ] || bash "scripts/tiers/$t.sh" --prepare || exit 1; done' _ $tiers \
    > "$prepare_log" 2>&1 &
prepare=$!
trap 'kill -- -"$prepare" 2>/dev/null || true; rm -rf "$site" "$prepare_log"' EXIT
failed=""
for tier in $tiers; do
    [ "$tier" = "none" ] && continue
    echo "=== tier $tier" >&2
    rc=0
    bash "scripts/tiers/$tier.sh" "$@" || rc=$?
    [ "$rc" -eq 5 ] && rc=0  # every test of the tier deselected by the arguments (e.g. -m cuda)
    [ "$rc" -eq 0 ] || failed="$failed $tier"
done
# a failed background build shows here; the tier itself built again in the foreground and said why
if ! wait "$prepare"; then echo "background preparation of the tiers failed:" >&2; tail -n 20 "$prepare_log" >&2; fi
grep "ready in" "$prepare_log" >&2 || true
[ -z "$failed" ] || echo "tiers failed:$failed" >&2
[ "$status" -ne 0 ] && exit "$status"
[ -z "$failed" ] || exit 1
