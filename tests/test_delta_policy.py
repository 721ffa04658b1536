"""``delta: auto`` chooses per version from measured seconds (weightsync/delta/policy.py): pure,
each test drives the policy with the seconds a link would give and asserts the ways it sends."""

from __future__ import annotations

import pytest

from weightsync.delta.policy import DELTA, FULL, PRIME, AutoPolicy


def drive(policy: AutoPolicy, versions: int, cost: dict[str, float], fails: set[int] = frozenset()) -> list[str]:
    """Send ``versions`` versions; the snapshot is a base after a committed PRIME or DELTA, and
    none after a FULL version (it skipped the snapshot) or a failed one."""
    ways, has_base = [], False
    for v in range(versions):
        way = policy.next(has_base)
        ok = v not in fails
        policy.record(way, cost[way], committed=ok)
        has_base = ok and way in (DELTA, PRIME)
        ways.append(way)
    return ways


def test_a_slow_link_settles_on_deltas_after_trying_both_ways():
    """Deltas 4x faster: the first version primes, two deltas and two full versions are timed,
    then deltas (after one prime: the full versions dropped the base) until the retry."""
    p = AutoPolicy(samples=2, retry_every=8)
    ways = drive(p, 14, {DELTA: 1.0, PRIME: 5.0, FULL: 4.0})
    assert ways == [PRIME, DELTA, DELTA, FULL, FULL, PRIME] + [DELTA] * 7 + [FULL]
    assert p.describe()["chosen"] is None  # retrying full after 8 versions


def test_a_fast_link_settles_on_full_versions_and_tries_a_delta_again_later():
    """Full versions 2x faster (gloo on loopback here): full versions, no snapshot, until the
    retry, which needs a prime before its delta."""
    p = AutoPolicy(samples=2, retry_every=4)
    ways = drive(p, 13, {DELTA: 1.3, PRIME: 1.5, FULL: 0.68})
    assert ways == [PRIME, DELTA, DELTA, FULL, FULL] + [FULL] * 4 + [PRIME, DELTA, DELTA, FULL]


def test_failed_versions_and_primes_are_no_samples():
    """A failed delta is not timed: a third delta is tried before the full ones."""
    p = AutoPolicy(samples=2, retry_every=100)
    ways = drive(p, 7, {DELTA: 1.0, PRIME: 5.0, FULL: 4.0}, fails={2})
    assert ways == [PRIME, DELTA, DELTA, PRIME, DELTA, FULL, FULL]
    assert p.describe()["delta_s"] == [1.0, 1.0] and p.describe()["full_s"] == [4.0, 4.0]


def test_a_delta_without_a_base_is_a_prime():
    p = AutoPolicy()
    assert p.next(has_base=False) == PRIME
    p.record(PRIME, 9.0, committed=True)
    assert p.next(has_base=False) == PRIME and p.next(has_base=True) == DELTA
    assert p.describe()["delta_s"] == []  # the first version is no sample


@pytest.mark.parametrize("kwargs", [{"samples": 0}, {"retry_every": 0}])
def test_nonsense_settings_are_refused(kwargs):
    with pytest.raises(ValueError):
        AutoPolicy(**kwargs)


def test_an_unknown_way_is_refused():
    p = AutoPolicy()
    p.record(PRIME, 1.0, True)
    with pytest.raises(ValueError, match="unknown way"):
        p.record("sideways", 1.0, True)


def test_one_slow_version_does_not_decide():
    """By default three versions of each way are timed and their medians compared: one full
    version slowed by its set-up (2.3 s) does not make 1.3 s deltas look faster than 0.7 s
    full versions."""
    p = AutoPolicy(retry_every=100)
    assert p.next(has_base=False) == PRIME
    p.record(PRIME, 5.0, True)
    for s in (1.3, 1.3, 1.3):
        assert p.next(has_base=True) == DELTA
        p.record(DELTA, s, True)
    for s in (2.3, 0.7, 0.7):
        assert p.next(has_base=False) == FULL
        p.record(FULL, s, True)
    assert p.next(has_base=False) == FULL and p.describe()["chosen"] == FULL
