"""Delta sync (config ``delta: on``) in real jobs: real Ray actors, every transport. Each version
moves a few percent of the elements (``drift``), as an RL step moves bf16 weights; each test
asserts one outcome: bit-exact weights and the sender's whole-version digest at every version,
a corrupted delta bucket rolled back on every transport, a receiver whose shadow drifted from
the sender's serving nothing until a full version, a receiver killed mid-delta (on broadcast
the group aborts and the survivor rolls back from its shadow) whose replacement, holding no
base, gets a full version."""

from __future__ import annotations

import pytest
import ray
import torch
from faultjob import DEADLINE_S, RECEIVERS, Job, apply_fails, sync_failed, wait_until
from support.parties import check_serves
from weightsync_bench.layouts import layout, materialize

from weightsync import transports
from weightsync.digest import version_digest
from weightsync.manifest import pack, plan_buckets

ALL = [t for t in ("shm", "ipc", "broadcast", "relay") if t in transports.names()]
MANIFEST = layout("tiny")  # 7 buckets of 64 KiB
BUCKET = 1 << 16
CHANGED = 0.01  # of the elements per version: about 2 % differ between two versions
PLAN = plan_buckets(MANIFEST, BUCKET, 256)
FULL = sum(b.nbytes for b in PLAN.buckets)  # bytes a full version moves (alignment gaps included)


def drift(version: int) -> dict[str, torch.Tensor]:
    """Version ``version``'s weights: one base, ``CHANGED`` of each tensor's elements (chosen
    by the version) replaced by the version's own values."""
    out = materialize(MANIFEST, seed=0)
    other = materialize(MANIFEST, seed=1000 + version)
    g = torch.Generator().manual_seed(version)
    for name, t in out.items():
        flat = t.view(-1)
        mask = torch.rand(flat.numel(), generator=g) < CHANGED
        flat[mask] = other[name].view(-1)[mask]
    return out


def packed(version: int) -> tuple[list[torch.Tensor], str]:
    """Version ``version`` as a full sync packs it: (its buckets, the whole version's xxh3 digest)."""
    bufs = [torch.zeros(BUCKET, dtype=torch.uint8) for _ in PLAN.buckets]
    digests = pack(PLAN, MANIFEST, drift(version), bufs, "xxh3")
    buckets = [bufs[b.index][: b.nbytes] for b in PLAN.buckets]
    return buckets, version_digest("xxh3", digests)


def full_digest(version: int) -> str:
    """The whole version's xxh3 digest as a full sync packs it."""
    return packed(version)[1]


@pytest.fixture(scope="module")
def transport(request):
    return request.param


@pytest.fixture(scope="module")
def job(ray_cluster, transport):
    j = Job(transport, MANIFEST, bucket_mb=BUCKET / 2**20, delta="on")
    yield j
    j.close()


def stage(job: Job, v: int):
    ray.get(job.trainer.stage.remote(v, None, 0.0, list(drift(v).items())), timeout=120)
    return job.trainer.sync.remote(v)


def step(job: Job, v: int, names=RECEIVERS) -> dict[str, int]:
    applied = {n: job.rollouts[n].apply.remote(v) for n in names}
    ray.get(stage(job, v), timeout=120)
    return {n: ray.get(ref, timeout=60) for n, ref in applied.items()}


def serves(job: Job, name: str) -> int | None:
    """The version ``name`` serves, once its weights are shown to be that version's, bit for bit."""
    rollout = job.rollouts[name]
    served = ray.get(rollout.version.remote())
    if served is None:
        return None
    got, bad = check_serves(rollout, drift(served))
    assert not bad, f"{name} claims version {got} but {len(bad)} tensors differ, e.g. {bad[:3]}"
    return served


def wire_bytes(job: Job, name: str) -> int:
    return ray.get(job.rollouts[name].counters.remote()).metrics.bytes


def fresh(job: Job) -> int:
    """Every receiver alive (restarted where killed) and serving a new version bit-exactly."""
    for name in sorted(job.dead):
        job.restart(name)
    v = job.next()
    assert step(job, v) == {n: v for n in RECEIVERS}
    assert [serves(job, n) for n in RECEIVERS] == [v, v]
    return v


@pytest.mark.parametrize("transport", ALL, indirect=True)
def test_corrupted_delta_bucket_rolls_back(job, transport):
    """A delta bucket corrupted in transit: both receivers raise ChecksumError naming the
    bucket and roll back to v-1 from their shadow (on every transport, ipc and broadcast
    included); SyncFailed names both; the next two versions are deltas (against v-1, then
    against the first) and every receiver ends bit-exact with the full-version digest."""
    base = fresh(job)
    v, k = job.next(), 3
    ray.get(job.trainer.tamper.remote(v, k, "corrupt"))
    applied = [r.apply.remote(v) for r in job.rollouts.values()]
    err = sync_failed(stage(job, v))
    assert set(err.failed) == set(RECEIVERS) and err.committed == [], err
    for why in err.failed.values():
        assert "ChecksumError" in why and f"bucket {k} of version {v}" in why, why
        assert f"rolled back to version {base} from the delta shadow" in why, why
    for ref in applied:
        apply_fails(ref, "ChecksumError", f"bucket {k} of version {v}")
    assert [serves(job, n) for n in RECEIVERS] == [base, base]
    ray.get(job.trainer.tamper.remote(-1, -1, "corrupt"))  # off
    for _ in range(2):
        assert_delta_version(job, job.next())


def assert_delta_version(job: Job, v: int) -> None:
    """``v`` commits on both receivers as a delta: a few percent of the bytes moved, the
    weights bit-exact, the rebuilt version's digest the full sync's."""
    assert step(job, v) == {n: v for n in RECEIVERS}
    for name in RECEIVERS:
        assert serves(job, name) == v
        m = ray.get(job.rollouts[name].counters.remote()).metrics
        assert m.bytes < FULL / 4, (name, m.bytes, FULL)
        assert m.digest == full_digest(v), name


def kept_word(base: int, v: int, k: int) -> int:
    """A byte offset in bucket ``k`` inside a tensor whose 2-byte word ``v`` leaves as ``base``
    had it: a bit flipped there in a shadow of ``base`` stays flipped after ``v``'s delta."""
    old, new = packed(base)[0][k], packed(v)[0][k]
    first = PLAN.buckets[k].slices[0]
    for offset in range(first.offset, first.offset + first.nbytes, 2):
        if torch.equal(old[offset: offset + 2], new[offset: offset + 2]):
            return offset
    raise AssertionError(f"every word of bucket {k}'s first tensor changes from version {base} to {v}")


def diverge(job: Job, names, k: int) -> tuple[int, int]:
    """A committed delta version ``base``, then one bit flipped in bucket ``k`` of the shadow
    of each of ``names``, in a word version ``v`` leaves alone; returns (base, v)."""
    fresh(job)
    base = job.next()
    assert_delta_version(job, base)
    v = job.next()
    ray.get([job.rollouts[n].corrupt_shadow.remote(k, kept_word(base, v, k)) for n in names])
    return base, v


DIVERGED = "the delta shadow differs from the sender's: serves no version until a full one"


def assert_diverged(job: Job, name: str, v: int, k: int, applied) -> None:
    """``name``'s apply of ``v`` raised the DeltaError of bucket ``k``; its own report says it
    trusts its shadow no more; it serves nothing, and the coordinator shows it serving nothing."""
    apply_fails(applied, "DeltaError", f"receiver '{name}': bucket {k} of version {v}: the rebuilt bucket differs")
    why = job.metrics(v).failed[name]  # the receiver's own report, whoever aborted v first
    assert f"DeltaError: receiver '{name}': bucket {k} of version {v}" in why and DIVERGED in why, why
    assert serves(job, name) is None and job.party(name).serving is None


@pytest.mark.parametrize("transport", ALL, indirect=True)
def test_diverged_shadow_serves_nothing_until_a_full_version(job, transport):
    """After a committed delta version, one bit of rollout-1's shadow flipped in bucket k (a
    word the next version leaves alone); rollout-0 stands after bucket k-1 (a fault point)
    until rollout-1 failed. v fails naming rollout-1 with the DeltaError of bucket k;
    rollout-1 no longer trusts its shadow: it reloads nothing from it and serves no version
    (its reason says so; the coordinator shows it serving nothing). rollout-0, whose shadow
    matches: on shm / ipc it commits v (each receiver reads alone); on broadcast the version
    aborts for it too (the sender cannot run more than two buckets ahead of a member, so it
    is stuck on rollout-1 and aborts the group, naming it) and it rolls back to v-1 from its
    shadow, bit-exact. The next version goes full to both and ends bit-exact with the
    full-version digest; the one after is a delta again."""
    k = 3
    base, v = diverge(job, ["rollout-1"], k)
    ray.get(job.rollouts["rollout-0"].hold_at.remote(v, k - 1))
    applied = {n: r.apply.remote(v) for n, r in job.rollouts.items()}
    sync = stage(job, v)
    assert ray.get(job.rollouts["rollout-0"].reached.remote(DEADLINE_S))
    wait_until("rollout-1 is failed in v", lambda: "rollout-1" in job.metrics(v).failed)
    if transport == "broadcast":
        wait_until("the sender aborted v", lambda: job.metrics(v).state == "ABORTED")
    ray.get(job.rollouts["rollout-0"].release.remote())
    err = sync_failed(sync)
    assert "rollout-1" in err.failed
    assert_diverged(job, "rollout-1", v, k, applied["rollout-1"])
    if transport == "broadcast":
        assert set(err.failed) == set(RECEIVERS) and err.committed == [], err
        assert "lost receiver 'rollout-1'" in err.failed["rollout-0"], err.failed["rollout-0"]
        apply_fails(applied["rollout-0"], "lost receiver 'rollout-1'")
        why = job.metrics(v).failed["rollout-0"]
        assert f"rolled back to version {base} from the delta shadow" in why, why
        assert serves(job, "rollout-0") == base
    else:
        assert set(err.failed) == {"rollout-1"} and err.committed == ["rollout-0"], err
        assert ray.get(applied["rollout-0"], timeout=60) == v and serves(job, "rollout-0") == v
    _full_then_delta(job)


@pytest.mark.parametrize("transport", ALL, indirect=True)
def test_every_shadow_diverged_the_next_version_goes_full(job, transport):
    """Both receivers' shadows flipped in bucket k after a committed delta version: v fails
    on both with the DeltaError of bucket k; neither serves a version (before the fix both
    reloaded the bad bytes, claimed v-1 and kept being sent deltas that failed again); so
    the next version goes full to both, bit-exact, and the one after is a delta again."""
    k = 3
    _, v = diverge(job, RECEIVERS, k)
    applied = {n: r.apply.remote(v) for n, r in job.rollouts.items()}
    err = sync_failed(stage(job, v))
    assert set(err.failed) == set(RECEIVERS) and err.committed == [], err
    for name in RECEIVERS:
        assert_diverged(job, name, v, k, applied[name])
    _full_then_delta(job)


def _kill_mid_version(job: Job, v: int) -> tuple[dict, object]:
    """Both rollouts stop after loading bucket 3 of ``v`` (a fault point), then rollout-1 is
    killed there; (each rollout's apply ref, the sender's sync ref)."""
    ray.get([r.hold_at.remote(v, 3) for r in job.rollouts.values()])
    applied = {n: r.apply.remote(v) for n, r in job.rollouts.items()}
    sync = stage(job, v)
    assert all(ray.get([r.reached.remote(DEADLINE_S) for r in job.rollouts.values()]))
    job.kill("rollout-1")
    return applied, sync


@pytest.mark.parametrize("transport", [t for t in ALL if t != "broadcast"], indirect=True)
def test_receiver_killed_mid_delta(job, transport):
    """rollout-1 killed after loading the middle bucket of a delta version: the sender's
    SyncFailed names only rollout-1; rollout-0 commits v. The restarted rollout-1 holds no
    base: catching up finds a committed delta and loads nothing (shm keeps v, as encoded
    buckets only); the next version goes full (the coordinator reports rollout-1 serving
    nothing) and both end bit-exact; the one after is a delta again. (broadcast: the test
    below.)"""
    fresh(job)
    v = job.next()
    applied, sync = _kill_mid_version(job, v)
    wait_until("rollout-1 is failed in v", lambda: "rollout-1" in job.metrics(v).failed)
    ray.get(job.rollouts["rollout-0"].release.remote())
    err = sync_failed(sync)
    assert set(err.failed) == {"rollout-1"} and err.committed == ["rollout-0"], err
    assert ray.get(applied["rollout-0"]) == v and serves(job, "rollout-0") == v
    restarted = job.restart("rollout-1")
    assert ray.get(restarted.apply.remote(None, None, False)) is None
    _full_then_delta(job)


@pytest.mark.parametrize("transport", ["broadcast"] if "broadcast" in ALL else [], indirect=True)
def test_receiver_killed_mid_delta_aborts_the_collective(job, transport):
    """broadcast: rollout-1 killed after loading the middle bucket of a delta version, where
    both receivers stand (a fault point). However small the delta's buckets, the sender
    cannot run ahead of a member by more than the two buckets it asked for (gloo sends only
    into a posted receive; NCCL / HCCL are collectives too): it is stuck on rollout-1 and,
    once the coordinator has seen rollout-1 silent, aborts v for the whole group, as for a
    full version killed mid-collective (test_broadcast.py). So SyncFailed names both,
    rollout-1 silent and rollout-0 for the lost member, nobody commits (nothing of v is served
    anywhere); but unlike a full version, rollout-0 rolls back to v-1 from its shadow and
    serves it bit-exact. The restarted rollout-1 holds no base: catching up loads nothing, the
    next version goes full, both end bit-exact, and the one after is a delta again."""
    base = fresh(job)
    v = job.next()
    applied, sync = _kill_mid_version(job, v)
    wait_until("the sender aborted v", lambda: job.metrics(v).state == "ABORTED")
    ray.get(job.rollouts["rollout-0"].release.remote())
    err = sync_failed(sync)
    assert set(err.failed) == set(RECEIVERS) and err.committed == [], err
    assert "silent" in err.failed["rollout-1"], err.failed["rollout-1"]
    assert "lost receiver 'rollout-1'" in err.failed["rollout-0"], err.failed["rollout-0"]
    apply_fails(applied["rollout-0"], "lost receiver 'rollout-1'")
    why = job.metrics(v).failed["rollout-0"]  # its own report
    assert f"rolled back to version {base} from the delta shadow" in why, why
    assert serves(job, "rollout-0") == base
    restarted = job.restart("rollout-1")
    assert ray.get(restarted.apply.remote(None, None, False)) is None
    _full_then_delta(job)


def _full_then_delta(job: Job) -> None:
    v = job.next()
    assert step(job, v) == {n: v for n in RECEIVERS}
    assert [serves(job, n) for n in RECEIVERS] == [v, v]
    assert [wire_bytes(job, n) for n in RECEIVERS] == [FULL, FULL]
    assert_delta_version(job, job.next())
