"""Control-plane calls per version (issue 27): the coordinator counts the calls it serves
(``Status.calls``), so a version's cost in round trips is measured, not guessed. Steady-state
versions (after warm-up ones, which open the session and allocate segments) on each transport,
one receiver."""

from __future__ import annotations

import pytest
import ray

# the calls one steady-state version makes, by op, sender and receiver together.
# Before issue 27, ipc and broadcast made one more: stage_info with the version digest after
# send(), now folded into wait_outcome (docs/benchmarks.md, "Coordinator calls per version").
PER_VERSION = {
    "shm": {"begin_stage": 1, "stage_info": 1, "staged": 1, "begin_sync": 1, "wait_outcome": 1,
            "wait_version": 1, "report": 1},
    # the sender learns the participants from its begin_sync, the receivers from the ring's
    # control block (the roster): no metrics call on either side (before issue 45: 2)
    "ipc": {"begin_stage": 1, "staged": 1, "begin_sync": 1, "wait_outcome": 1,
            "wait_version": 1, "report": 1},
    "broadcast": {"begin_stage": 1, "staged": 1, "begin_sync": 1, "bcast_form": 1, "wait_outcome": 1,
                  "wait_version": 1, "bcast_group": 1, "report": 1},
}
# calls made on a timer, not per version: heartbeats, and the abort checks of a party that
# waits longer than a tick (0.2 s) for a bucket or a release (get_state, metrics), which a loaded
# machine adds; for these only the untimed floor is compared
TIMED = {"heartbeat", "status", "get_state", "metrics"}
WARMUP, VERSIONS = 3, 3


def _calls(coord) -> dict[str, int]:
    return dict(coord.status().calls)


# what each party calls at a pre-staged barrier (stage() done before the rollout asks): the
# sender's begin_sync and wait_outcome, the receiver's wait_version and report. broadcast adds
# its group's membership on each side (bcast_form, bcast_group)
BARRIER_CALLS = {"shm": (2, 2), "ipc": (2, 2), "broadcast": (3, 3)}


@pytest.mark.parametrize("transport", list(PER_VERSION))
def test_calls_per_version(start_job, transport):
    """The coordinator's count by op over step()s; then each party's own count at pre-staged
    barriers (SyncResult.sync_calls, the receiver's ``last_metrics.calls``)."""
    config = {"transport": transport, "bucket_mb": 1 / 16, "device": "cpu"}
    coord, rs, trainer = start_job(config, 1)

    def version(v: int) -> None:
        applied = rs[0].apply.remote(v)
        ray.get(trainer.step.remote(v))
        assert ray.get(applied) == v

    for v in range(1, 1 + WARMUP):
        version(v)
    before = _calls(coord)
    for v in range(1 + WARMUP, 1 + WARMUP + VERSIONS):
        version(v)
    after = _calls(coord)
    made = {op: (n - before.get(op, 0)) / VERSIONS for op, n in after.items() if n != before.get(op, 0)}
    expected = PER_VERSION[transport]
    seen = {op: min(n, expected.get(op, 0)) if op in TIMED else n for op, n in made.items()}
    by_party = set()
    for v in range(1 + WARMUP + VERSIONS, 1 + WARMUP + 2 * VERSIONS):
        ray.get(trainer.stage.remote(v))
        applied = rs[0].apply.remote(v)
        result = ray.get(trainer.sync.remote(v))
        assert ray.get(applied) == v
        by_party.add((result.sync_calls, ray.get(rs[0].counters.remote()).metrics.calls))
    assert ({op: n for op, n in seen.items() if n}, by_party) == (expected, {BARRIER_CALLS[transport]})
