"""The version protocol over the shm transport, with real Ray actors in separate processes."""

import threading

import pytest
import ray
from support.parties import (
    assert_same_weights,
    assert_serves,
    rollout_actor,
    trainer_actor,
    wait_until,
)
from weightsync_bench.engine import ToyEngine
from weightsync_bench.layouts import layout, materialize

from weightsync import ManifestError, SyncConfig, SyncFailed, VersionError, WeightReceiver, WeightSender
from weightsync.manifest import Manifest, TensorSpec
from weightsync.transports.shm.transport import locate

# tiny layout with a 64 KiB bucket: the embedding (1000 x 64 bf16 = 125 KiB) is split in chunks
CFG = {"transport": "shm", "bucket_mb": 1 / 16, "device": "cpu"}
MANIFEST = layout("tiny")


def test_twenty_versions_bit_exact(start_job):
    assert max(s.nbytes for s in MANIFEST) > CFG["bucket_mb"] * 2**20, "layout must exercise chunking"
    coord, rs, trainer = start_job(CFG)
    for v in range(1, 21):
        applied = [r.apply.remote(v) for r in rs]
        result = ray.get(trainer.step.remote(v))
        assert ray.get(applied) == [v, v]
        assert result.metrics.state == "COMMITTED"
        assert sorted(result.metrics.committed) == ["rollout-0", "rollout-1"]
        for r in rs:
            assert_serves(r, MANIFEST, v)
    counters = ray.get(rs[0].counters.remote())
    assert counters.post_loads == 20, "post-load hook runs once per version"
    status = coord.status()
    assert status.latest_committed == 20
    assert {p.name: p.serving for p in status.parties if p.role == "receiver"} == {
        "rollout-0": 20, "rollout-1": 20}
    assert "COMMITTED" in coord.format_status()


def test_prestaged_version_then_barrier(start_job):
    coord, rs, trainer = start_job(CFG, 1)
    ray.get(trainer.stage.remote(5))
    assert coord.metrics(5).state == "STAGED"
    applied = rs[0].apply.remote(5)
    result = ray.get(trainer.sync.remote(5))
    assert ray.get(applied) == 5 and result.metrics.state == "COMMITTED"
    assert_serves(rs[0], MANIFEST, 5)


def test_late_joiner_serves_latest_committed(start_job, actors):
    coord, rs, trainer = start_job(CFG, 1)
    for v in (1, 2, 3):
        applied = rs[0].apply.remote(v)
        ray.get(trainer.step.remote(v))
        ray.get(applied)
    late = actors.add(rollout_actor(coord, MANIFEST, "late", rank=9, config=CFG))
    assert ray.get(late.version.remote()) is None
    assert ray.get(late.apply.remote(None, None, False)) == 3, "catches up without the trainer"
    assert_serves(late, MANIFEST, 3)
    # and takes part in the next version like everyone else
    applied = [r.apply.remote(4) for r in (rs[0], late)]
    ray.get(trainer.step.remote(4))
    assert ray.get(applied) == [4, 4]
    assert_serves(late, MANIFEST, 4)


def _corrupt(coord, version, bucket_offset):
    info = coord.metrics(version).info
    path = locate(info["segment"], "/dev/shm")  # its file, or /proc/<pid>/fd/<fd> of a memfd
    with open(path, "r+b") as f:
        f.seek(bucket_offset)
        byte = f.read(1)
        f.seek(bucket_offset)
        f.write(bytes([byte[0] ^ 0x40]))


@pytest.mark.scenario("bad input", "bucket corrupted in transit")
@pytest.mark.parametrize("where", ["first-bucket", "later-bucket"])
def test_corrupted_bucket_is_not_applied(start_job, where):
    from weightsync.manifest import plan_buckets
    from weightsync.transports.shm.transport import layout as seg_layout

    coord, rs, trainer = start_job(CFG, 2)
    applied = [r.apply.remote(1) for r in rs]
    ray.get(trainer.step.remote(1))
    ray.get(applied)
    ray.get(trainer.stage.remote(2))
    plan = plan_buckets(MANIFEST, int(CFG["bucket_mb"] * 2**20), 256)
    _, bases = seg_layout(plan)
    bucket = 0 if where == "first-bucket" else plan.bucket_count - 1
    _corrupt(coord, 2, bases[bucket] + 3)
    applied = [r.apply.remote(2) for r in rs]
    with pytest.raises(SyncFailed) as err:
        ray.get(trainer.sync.remote(2))
    assert set(err.value.failed) == {"rollout-0", "rollout-1"}
    assert all("ChecksumError" in why and f"bucket {bucket}" in why for why in err.value.failed.values())
    for ref in applied:
        with pytest.raises(Exception, match="corrupted"):
            ray.get(ref)
    for r in rs:
        assert ray.get(r.version.remote()) == 1, "still serves the previous version"
        assert_serves(r, MANIFEST, 1)
    if where == "later-bucket":
        assert "rolled back to version 1" in err.value.failed["rollout-0"]
    # the next clean version goes through
    applied = [r.apply.remote(3) for r in rs]
    ray.get(trainer.step.remote(3))
    assert ray.get(applied) == [3, 3]
    assert_serves(rs[1], MANIFEST, 3)


@pytest.mark.parametrize(
    "change,pattern",
    [
        (lambda specs: [TensorSpec("model.bogus", s.dtype, s.shape) if i == 3 else s for i, s in enumerate(specs)],
         "unknown tensor 'model.bogus'"),
        (lambda specs: [TensorSpec(s.name, s.dtype, (s.shape[0] + 1,) + s.shape[1:]) if i == 1 else s
                        for i, s in enumerate(specs)], "has shape"),
        (lambda specs: [TensorSpec(s.name, "float32", s.shape) if i == 2 else s for i, s in enumerate(specs)],
         "has dtype float32"),
    ],
    ids=["unknown-name", "wrong-shape", "wrong-dtype"],
)
def test_manifest_mismatch_fails_before_anything_is_applied(coordinator_factory, actors, change, pattern):
    coord = coordinator_factory(CFG)
    sender_manifest = Manifest(tuple(change(list(MANIFEST))))
    good = actors.add(rollout_actor(coord, MANIFEST, "good", config=CFG))
    trainer = actors.add(trainer_actor(coord, sender_manifest, CFG, receivers=1))
    applied = good.apply.remote(1)
    with pytest.raises(SyncFailed, match=pattern):
        ray.get(trainer.step.remote(1))
    with pytest.raises(ManifestError, match=pattern):
        ray.get(applied)
    counters = ray.get(good.counters.remote())
    assert counters.loads == 0 and ray.get(good.version.remote()) is None, "not a byte was loaded"
    assert any(p.manifest == "rejected" for p in coord.status().parties)


@pytest.mark.scenario("bad input", "version going backwards / reused with different content")
def test_version_going_backwards_or_reused_is_refused(start_job):
    coord, rs, trainer = start_job(CFG, 1)
    applied = rs[0].apply.remote(7)
    ray.get(trainer.step.remote(7))
    ray.get(applied)
    with pytest.raises(VersionError, match="version 6 goes backwards"):
        ray.get(trainer.stage.remote(6))
    with pytest.raises(VersionError, match="version 7 is reused"):
        ray.get(trainer.stage.remote(7))
    with pytest.raises(VersionError, match="never staged"):
        ray.get(trainer.sync.remote(8))
    assert ray.get(rs[0].version.remote()) == 7
    assert_serves(rs[0], MANIFEST, 7)


def test_in_process_api_and_resources_return_to_zero(coordinator_factory):
    """The README example shape: sender and receiver objects, no actors of our own."""
    coord = coordinator_factory(CFG)
    engine = ToyEngine(MANIFEST)
    receiver = WeightReceiver(coord, engine.load_weights, name="local", post_load=engine.post_load,
                              expected=engine.params)
    sender = WeightSender(coord, expected_receivers=1)
    try:
        weights = materialize(MANIFEST, seed=11)
        sender.stage(11, weights)
        import threading

        t = threading.Thread(target=receiver.apply, args=(11,))
        t.start()
        result = sender.sync(11)
        t.join(30)
        assert receiver.version == 11 and result.bytes == MANIFEST.total_bytes
        assert_same_weights(engine.params, weights)
        assert coord.status().resources["shm_segments"] == 1
    finally:
        receiver.close()
        sender.close()
    assert all(n == 0 for n in coord.status().resources.values())


def test_a_manifest_rejected_after_the_barrier_began_fails_the_version_at_once(coordinator_factory):
    """The receiver checks the manifest only after the sender's barrier counted it in (a busy
    rollout opens its session late): the version fails naming the rejection, not after
    sync_timeout_s as a silent receiver (a CI run under load waited 300 s here)."""
    coord = coordinator_factory(CFG)
    engine = ToyEngine(MANIFEST)
    receiver = WeightReceiver(coord, engine.load_weights, name="late", expected=engine.params)
    wider = Manifest(tuple(TensorSpec(s.name, s.dtype, (s.shape[0] + 1,) + s.shape[1:]) if i == 1 else s
                           for i, s in enumerate(MANIFEST)))
    sender = WeightSender(coord, expected_receivers=1)
    outcome: list[BaseException] = []

    def sync():
        try:
            sender.sync(1, timeout=600)
        except BaseException as exc:  # the failure under test
            outcome.append(exc)

    try:
        sender.stage(1, materialize(wider, seed=1))
        t = threading.Thread(target=sync)
        t.start()
        wait_until("the barrier began", lambda: coord.metrics(1).participants == ["late"], timeout=60)
        with pytest.raises(ManifestError, match="has shape"):
            receiver.apply(1)
        t.join(120)
        assert not t.is_alive(), "sync() still waits for a receiver that rejected the manifest"
        assert isinstance(outcome[0], SyncFailed) and "has shape" in outcome[0].failed["late"], outcome
    finally:
        receiver.close()
        sender.close()


def test_a_loader_that_fails_again_during_rollback_is_reported_not_silent(coordinator_factory):
    """The engine's loader raises on version 2 and again when version 1 is loaded back: the
    receiver serves nothing and its report names both failures at once (it used to report
    nothing, so the sender waited out sync_timeout_s and blamed a silent receiver)."""
    coord = coordinator_factory(CFG)
    engine = ToyEngine(MANIFEST)
    broken = threading.Event()

    def load(pairs):
        if broken.is_set():
            raise RuntimeError("engine refused the weights")
        return engine.load_weights(pairs)

    receiver = WeightReceiver(coord, load, name="local", expected=engine.params)
    sender = WeightSender(coord, expected_receivers=1)
    errors: list[BaseException] = []

    def apply(v):
        try:
            receiver.apply(v)
        except BaseException as exc:  # the failure under test
            errors.append(exc)

    try:
        for v in (1, 2):
            sender.stage(v, materialize(MANIFEST, seed=v))
            if v == 2:
                broken.set()
            t = threading.Thread(target=apply, args=(v,))
            t.start()
            if v == 1:
                sender.sync(v)
            else:
                with pytest.raises(SyncFailed) as err:
                    sender.sync(v, timeout=30)
            t.join(30)
        assert "engine refused the weights; rollback to version 1 failed too (RuntimeError" in err.value.failed["local"]
        assert receiver.version is None and [type(e).__name__ for e in errors] == ["RuntimeError"]
    finally:
        receiver.close()
        sender.close()


def test_more_buckets_than_one_header_page_holds(coordinator_factory):
    """A segment's header grows with the bucket count: an 8B model in 16 MiB buckets has
    about a thousand buckets, more than one 4 KiB page of ready words and checksums."""
    config = {**CFG, "bucket_mb": 1 / 1024}  # 1 KiB buckets: about 400 of them
    from weightsync.manifest import plan_buckets

    assert plan_buckets(MANIFEST, 1024).bucket_count > 4096 // 16
    coord = coordinator_factory(config)
    engine = ToyEngine(MANIFEST)
    cfg = SyncConfig.load(config)
    receiver = WeightReceiver(coord, engine.load_weights, name="local", expected=engine.params, config=cfg)
    sender = WeightSender(coord, expected_receivers=1, config=cfg)
    try:
        import threading

        for v in (1, 2):
            weights = materialize(MANIFEST, seed=v)
            sender.stage(v, weights)
            t = threading.Thread(target=receiver.apply, args=(v,))
            t.start()
            sender.sync(v)
            t.join(60)
            assert receiver.version == v
            assert_same_weights(engine.params, weights)
    finally:
        receiver.close()
        sender.close()


def test_each_bucket_is_verified_once_per_node(start_job):
    """Receivers read the same pages: one hashes a bucket and marks it, the others load it."""
    from weightsync.manifest import plan_buckets

    buckets = plan_buckets(MANIFEST, int(CFG["bucket_mb"] * 2**20), 256).bucket_count
    coord, rs, trainer = start_job(CFG, 3)
    for v in (1, 2, 3):
        applied = [r.apply.remote(v) for r in rs]
        ray.get(trainer.step.remote(v))
        assert ray.get(applied) == [v, v, v]
        skipped = [ray.get(r.counters.remote()).metrics.peer_verified_buckets for r in rs]
        # 3 receivers x every bucket, of which exactly one hash per bucket happened
        assert sum(skipped) == 2 * buckets, f"version {v}: buckets left to a peer {skipped} of {buckets}"
        for r in rs:
            assert_serves(r, MANIFEST, v)


def test_two_threads_of_one_receiver_hash_each_bucket_once():
    """A prefetch() thread beside apply() in one process: fcntl locks belong to the process,
    so without a lock of its own the two threads would hash the same buckets side by side."""
    import threading

    import torch

    from weightsync.manifest import Packer, plan_buckets
    from weightsync.transports import Deadline, TransportContext, shm_version
    from weightsync.transports.shm.transport import ShmReceiver, ShmSender

    manifest = Manifest(tuple(TensorSpec(f"w{i}", "float32", (256, 1024)) for i in range(16)))  # 16 MiB
    cfg = SyncConfig(bucket_mb=1, device="cpu")
    plan = plan_buckets(manifest, cfg.bucket_bytes, cfg.align_bytes)
    ctx = TransportContext(config=cfg, plan=plan, manifest=manifest, digest=manifest.digest(), session="t",
                           name="p", rank=0, device=torch.device("cpu"), digest_kind="xxh3")
    named = materialize(manifest, seed=3)
    sender = ShmSender(ctx)
    receiver = ShmReceiver(ctx, sender.session)
    try:
        record = shm_version(sender.stage(1, 0, Packer(plan, manifest, named)).to_wire())
        hashed = [[0] * plan.bucket_count for _ in range(2)]
        start = threading.Barrier(2)

        def verify_all(mine: list[int]) -> None:
            start.wait()
            for bucket in receiver.receive(1, record, Deadline(1, float("inf"))):
                mine[bucket.index] += bucket.checked == "here"

        threads = [threading.Thread(target=verify_all, args=(h,)) for h in hashed]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert [a + b for a, b in zip(*hashed)] == [1] * plan.bucket_count, hashed
    finally:
        receiver.close()
        sender.close()


def test_prefetch_verifies_ahead_and_apply_only_loads(start_job):
    """prefetch() while the engine would generate: the barrier is left with loading only; a
    bucket corrupted before the prefetch stays unmarked and apply() still refuses it."""
    from weightsync.manifest import plan_buckets
    from weightsync.transports.shm.transport import layout as seg_layout

    plan = plan_buckets(MANIFEST, int(CFG["bucket_mb"] * 2**20), 256)
    coord, rs, trainer = start_job(CFG, 2)
    ray.get(trainer.stage.remote(1))
    assert ray.get(rs[0].prefetch.remote()) == 1
    assert ray.get(rs[1].prefetch.remote(1)) == 1  # everything marked already: nothing to hash
    applied = [r.apply.remote(1) for r in rs]
    assert ray.get(trainer.sync.remote(1)).metrics.state == "COMMITTED"
    assert ray.get(applied) == [1, 1]
    for r in rs:
        assert ray.get(r.counters.remote()).metrics.peer_verified_buckets == plan.bucket_count
        assert_serves(r, MANIFEST, 1)
    assert ray.get(rs[0].prefetch.remote(1)) is None, "nothing newer than what it serves"

    ray.get(trainer.stage.remote(2))
    _, bases = seg_layout(plan)
    _corrupt(coord, 2, bases[plan.bucket_count // 2] + 5)
    assert ray.get(rs[0].prefetch.remote(2)) is None  # found the bad bucket, marked nothing for it
    applied = [r.apply.remote(2) for r in rs]
    with pytest.raises(SyncFailed) as err:
        ray.get(trainer.sync.remote(2))
    assert set(err.value.failed) == {"rollout-0", "rollout-1"}
    assert all("ChecksumError" in why for why in err.value.failed.values())
    for ref in applied:
        with pytest.raises(Exception, match="corrupted"):
            ray.get(ref)
    for r in rs:
        assert ray.get(r.version.remote()) == 1
        assert_serves(r, MANIFEST, 1)


def test_a_party_joins_the_session_when_opened_not_when_built(coordinator_factory):
    """Building a party's membership touches no network: registration and the heartbeat begin
    in open(), which WeightSender and WeightReceiver call last in their constructors."""
    from weightsync.coordinator.client import Member

    coord = coordinator_factory(CFG)
    member = Member(coord, role="sender", name="p-0", rank=0)
    try:
        before = [p.name for p in coord.status().parties]
        member.open()
        after = [p.name for p in coord.status().parties]
        assert (before, after) == ([], ["p-0"])
    finally:
        member.close()
