"""Delta encoding (weightsync/delta/codec.py), the trainer's snapshot and the encoded buckets it hands
a transport (delta/sender.py), a receiver's shadow (delta/receiver.py), and when a session runs
delta sync at all, without a job."""

from __future__ import annotations

import pytest
import torch

from weightsync.config import SyncConfig
from weightsync.delta import codec as delta
from weightsync.delta.receiver import DeltaReceiver
from weightsync.delta.sender import DeltaSender, host_reserve, wanted
from weightsync.digest import xxh3
from weightsync.errors import ConfigError, ManifestError, ProtocolError
from weightsync.manifest import build_manifest, plan_buckets
from weightsync.records import DeltaRecord, VersionRecord
from weightsync.transports.shm.transport import ShmVersion


def bucket(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def flip(buf: torch.Tensor, words: list[int]) -> torch.Tensor:
    out = buf.clone()
    w = out.numpy().view(delta.word_dtype(out.numel()))
    for i in words:
        w[i] = ~w[i]
    return out


def test_config_delta_choices():
    assert SyncConfig().delta == "off"
    assert SyncConfig(delta="auto").delta == "auto"
    with pytest.raises(ConfigError, match="delta"):
        SyncConfig(delta="sometimes")


def test_unchanged_bucket_is_skipped():
    old = bucket(4096)
    assert delta.encode(old, old.clone()) == (delta.SKIP, None)


@pytest.mark.parametrize("n", [4096, 4095])  # 2-byte words, and 1-byte words for an odd length
def test_sparse_round_trip_and_undo(n):
    old = bucket(n)
    new = flip(old, [0, 7, 100, n // delta.word_dtype(n).itemsize - 1])
    kind, payload = delta.encode(old, new)
    assert kind == delta.SPARSE
    assert payload.numel() == delta.sparse_bytes(4, n) < n
    target = old.clone()
    undo = delta.apply(target, kind, payload)
    assert torch.equal(target, new)
    assert undo.nbytes < n
    delta.revert(target, undo)
    assert torch.equal(target, old)


def test_many_changes_go_full_and_undo_restores():
    old = bucket(1024)
    new = flip(old, list(range(0, 512, 2)))  # half the words: sparse would be larger
    kind, payload = delta.encode(old, new)
    assert kind == delta.FULL and payload is new
    target = old.clone()
    undo = delta.apply(target, kind, payload)
    assert torch.equal(target, new)
    delta.revert(target, undo)
    assert torch.equal(target, old)


def test_no_base_is_full():
    new = bucket(256)
    assert delta.encode(None, new) == (delta.FULL, new)


@pytest.mark.parametrize("mangle, match", [
    (lambda p: p[:10], "shorter than its header"),
    (lambda p: p[:-1], "does not fit"),
    (lambda p: _set_pos(p, 0, 10**6), "out of the bucket"),
    (lambda p: _set_pos(p, 1, 0), "out of order"),
])
def test_mangled_sparse_delta_is_refused_before_writing(mangle, match):
    old = bucket(4096)
    kind, payload = delta.encode(old, flip(old, [5, 9, 11]))
    target = old.clone()
    with pytest.raises(delta.DeltaError, match=match):
        delta.apply(target, kind, mangle(payload.clone()), "bucket 3")
    assert torch.equal(target, old)


def _set_pos(payload: torch.Tensor, i: int, value: int) -> torch.Tensor:
    payload[delta.HEADER: delta.HEADER + 12].view(torch.int32)[i] = value  # 3 positions
    return payload


def test_auto_is_off_on_memory_speed_transports():
    assert [wanted("auto", t) for t in ("shm", "ipc", "broadcast")] == [False, False, True]
    assert all(wanted("on", t) for t in ("shm", "ipc", "broadcast"))
    assert not any(wanted("off", t) for t in ("shm", "ipc", "broadcast"))


def test_auto_rule():
    assert delta.pays(10, 100, "on") and delta.pays(90, 100, "on")
    assert delta.pays(50, 100, "auto") and not delta.pays(51, 100, "auto")
    assert not delta.pays(0, 100, "off")


def test_wire_plan_and_record():
    m = build_manifest({f"t{i}": torch.zeros(300, dtype=torch.bfloat16) for i in range(6)})
    plan = plan_buckets(m, 2048)
    lengths = [0] + [b.nbytes for b in plan.buckets[1:]]
    wp = plan.with_lengths(lengths)
    assert [b.nbytes for b in wp.buckets] == lengths and wp.bucket_count == plan.bucket_count
    with pytest.raises(ValueError):
        plan.with_lengths(lengths[:-1])
    rec = DeltaRecord(base=3, kinds=[delta.SKIP] + [delta.FULL] * (plan.bucket_count - 1), lengths=lengths,
                      digests=[1] * plan.bucket_count)
    wire = ShmVersion(segment="x", size=1, delta=rec).to_wire()
    assert ShmVersion.from_wire(wire).delta == rec
    assert VersionRecord.from_wire({}).delta is None
    bad = dict(wire["delta"], kinds=["sparse"] * plan.bucket_count, base=None)
    with pytest.raises(ProtocolError, match="full without a base"):
        DeltaRecord.from_wire(bad)
    with pytest.raises(ProtocolError, match="lengths"):
        DeltaRecord.from_wire(dict(wire["delta"], lengths=[1] * plan.bucket_count))


def _versions(m, count: int, changed: float, seed: int = 0):
    """``count`` versions of bf16 weights, each with ``changed`` of its elements moved."""
    g = torch.Generator().manual_seed(seed)
    cur = {s.name: torch.randn(s.shape, generator=g).to(s.torch_dtype) for s in m}
    out = []
    for _ in range(count):
        cur = {n: t.clone() for n, t in cur.items()}
        for n, t in cur.items():
            if n.startswith("frozen"):
                continue
            flat = t.view(-1)
            idx = torch.randperm(flat.numel(), generator=g)[: max(1, int(flat.numel() * changed))]
            flat[idx] = torch.randn(idx.numel(), generator=g).to(t.dtype)
        out.append(cur)
    return out


class _Model:
    def __init__(self, m):
        self.params = {s.name: torch.zeros(s.shape, dtype=s.torch_dtype) for s in m}

    def load(self, pairs):
        for n, t in pairs:
            self.params[n].copy_(t)


def _run(sender: DeltaSender, rx: DeltaReceiver, model: _Model, v: int, weights, serving, fail_at: int | None = None):
    packer, record, _ = sender.prepare(v, weights, serving)
    wire = _wire(packer)
    rx.begin(v, record)
    try:
        for b in range(sender.plan.bucket_count):
            if b == fail_at:
                raise RuntimeError("lost")
            pairs, got = rx.apply(v, record, b, wire[b])
            assert got == record.digests[b]
            model.load(pairs)
    except RuntimeError:
        undone = rx.failed(None if record.base is None else record.base)
        for pairs in undone.reload:
            model.load(pairs)
        sender.resolved(v, committed=False)
        return record, undone.version
    rx.committed(v)
    sender.resolved(v, committed=True)
    return record, v


def _wire(packer) -> list[torch.Tensor]:
    """The buckets a transport would move, as it fills them from the packer (one scratch buffer)."""
    buf, out = torch.empty(packer.plan.bucket_bytes, dtype=torch.uint8), []
    for b in range(packer.plan.bucket_count):
        packer.fill(b, buf)
        out.append(buf[: packer.plan.buckets[b].nbytes].clone())
    return out


def test_sender_and_receiver_stay_bit_exact_and_roll_back():
    m = build_manifest({f"w{i}": torch.zeros(1000 + 37 * i, dtype=torch.bfloat16) for i in range(5)}
                       | {"big": torch.zeros(3000, dtype=torch.bfloat16), "frozen": torch.zeros(512)})
    plan = plan_buckets(m, 2048)
    sender, rx, model = DeltaSender(plan, m, "on"), DeltaReceiver(plan, m, "rollout-0"), _Model(m)
    versions = _versions(m, 4, 0.02)
    for v, w in enumerate(versions[:3]):
        record, served = _run(sender, rx, model, v, dict(w), [rx.version])
        assert served == v
        assert (record.base is None) == (v == 0)
        for n, t in w.items():
            assert torch.equal(model.params[n].view(torch.uint8), t.view(torch.uint8)), (v, n)
        assert [xxh3(rx.bucket(b)) for b in range(plan.bucket_count)] == record.digests
    assert delta.SPARSE in record.kinds and sum(record.lengths) < plan.payload_bytes / 2
    # the 'frozen' tensor never changed and has a bucket of its own: skipped
    assert record.kinds[plan.tensor_slices[m.index()["frozen"]][0].bucket] == delta.SKIP
    # a failure in the middle: both ends put version 2 back, the model holds version 2 again
    record, served = _run(sender, rx, model, 3, dict(versions[3]), [rx.version], fail_at=plan.bucket_count - 1)
    assert served == 2 and rx.version == 2 and sender.base == 2
    for n, t in versions[2].items():
        assert torch.equal(model.params[n].view(torch.uint8), t.view(torch.uint8)), n
    # the next version is a delta against 2 again and lands exactly
    record, served = _run(sender, rx, model, 4, dict(versions[3]), [rx.version])
    assert served == 4 and record.base == 2


def test_receiver_behind_gets_full_and_a_wrong_base_is_refused():
    m = build_manifest({f"w{i}": torch.zeros(2000, dtype=torch.bfloat16) for i in range(3)})
    plan = plan_buckets(m, 4096)
    sender, rx = DeltaSender(plan, m, "on"), DeltaReceiver(plan, m, "rollout-1")
    versions = _versions(m, 3, 0.01)
    _run(sender, rx, _Model(m), 0, dict(versions[0]), [None])
    _run(sender, rx, _Model(m), 1, dict(versions[1]), [0])
    # a delta whose base the receiver does not hold is refused before the shadow changes
    fresh = DeltaReceiver(plan, m, "rollout-2")
    _, record, _ = sender.prepare(2, dict(versions[2]), [1])
    assert record.base == 1
    with pytest.raises(delta.DeltaError, match="rollout-2.*holds no version.*delta against version 1"):
        fresh.begin(2, record)
    assert fresh.failed(None) is None and fresh.version is None
    sender.resolved(2, committed=False)  # the undo records put version 1 back
    assert sender.base == 1
    # a receiver the coordinator reports on another version: the sender sends full
    _, record, _ = sender.prepare(3, dict(versions[2]), [1, None])
    assert record.base is None and set(record.kinds) == {delta.FULL}
    sender.resolved(3, committed=False)  # a full version keeps no undo: no base afterwards
    assert sender.base is None


def test_misapplied_delta_fails_naming_receiver_and_bucket():
    m = build_manifest({f"w{i}": torch.zeros(2000, dtype=torch.bfloat16) for i in range(3)})
    plan = plan_buckets(m, 4096)
    sender, rx, model = DeltaSender(plan, m, "on"), DeltaReceiver(plan, m, "rollout-0"), _Model(m)
    versions = _versions(m, 2, 0.01)
    _run(sender, rx, model, 0, dict(versions[0]), [None])
    rx.bucket(1)[10] ^= 1  # the shadow drifted: the next delta rebuilds another bucket than the sender's
    packer, record, _ = sender.prepare(1, dict(versions[1]), [0])
    wire = _wire(packer)
    rx.begin(1, record)
    rx.apply(1, record, 0, wire[0])
    with pytest.raises(delta.DeltaError, match="receiver 'rollout-0': bucket 1 of version 1: the rebuilt bucket differs"):
        rx.apply(1, record, 1, wire[1])


def test_a_diverged_shadow_reloads_nothing_and_is_no_base():
    """After a rebuilt bucket differed from the sender's, failed() neither reverts nor reloads
    (the bad bytes would go back into the model) and the receiver holds no base."""
    m = build_manifest({f"w{i}": torch.zeros(2000, dtype=torch.bfloat16) for i in range(3)})
    plan = plan_buckets(m, 4096)
    sender, rx, model = DeltaSender(plan, m, "on"), DeltaReceiver(plan, m, "rollout-0"), _Model(m)
    versions = _versions(m, 2, 0.01)
    _run(sender, rx, model, 0, dict(versions[0]), [None])
    rx.bucket(1)[10] ^= 1
    packer, record, _ = sender.prepare(1, dict(versions[1]), [0])
    wire = _wire(packer)
    rx.begin(1, record)
    model.load(rx.apply(1, record, 0, wire[0])[0])
    with pytest.raises(delta.DeltaError):
        rx.apply(1, record, 1, wire[1])
    undone = rx.failed(0)
    assert (undone.why, undone.reload, undone.version, rx.version) == (
        "; the delta shadow differs from the sender's: serves no version until a full one", [], None, None)


def test_auto_falls_back_to_full_when_most_words_change():
    m = build_manifest({"w": torch.zeros(4000, dtype=torch.bfloat16)})
    plan = plan_buckets(m, 8192)
    sender = DeltaSender(plan, m, "auto")
    versions = _versions(m, 2, 0.9)
    sender.prepare(0, dict(versions[0]), [None])
    sender.resolved(0, committed=True)
    _, record, _ = sender.prepare(1, dict(versions[1]), [0])
    assert record.base is None and record.kinds == [delta.FULL] * plan.bucket_count


def test_failed_staging_leaves_the_snapshot():
    m = build_manifest({f"w{i}": torch.zeros(2000, dtype=torch.bfloat16) for i in range(3)})
    plan = plan_buckets(m, 4096)
    sender = DeltaSender(plan, m, "on")
    versions = _versions(m, 2, 0.01)
    sender.prepare(0, dict(versions[0]), [None])
    sender.resolved(0, committed=True)
    before = sender.snapshot.clone()
    bad = list(versions[1].items())[:2] + [("w2", torch.zeros(5))]
    with pytest.raises(ManifestError):
        sender.prepare(1, bad, [0])
    assert torch.equal(sender.snapshot, before) and sender.base == 0


def test_the_auto_shm_budget_leaves_room_for_the_trainer_snapshot():
    from weightsync.transports.shm.transport import choose_mode
    from weightsync.transports.shm.transport import layout as segment_layout

    m = build_manifest({f"w{i}": torch.zeros(30000, dtype=torch.bfloat16) for i in range(6)})
    plan = plan_buckets(m, 1 << 16)
    snapshot = delta.snapshot_bytes(plan.bucket_count, plan.bucket_bytes)
    # the node can give exactly what 3 whole versions need under the auto fraction
    can = int(3 * segment_layout(plan)[0] / 0.5) + 1
    def mode(delta_mode: str):
        # the sender reserves its snapshot's host bytes in the context it builds the transport with
        return choose_mode(plan, SyncConfig(bucket_mb=1 / 16, delta=delta_mode), capacity=lambda _c: can,
                           reserve=host_reserve(delta_mode, "shm", plan))

    off, on, auto = mode("off"), mode("on"), mode("auto")
    assert not auto.streaming  # auto is off on shm: no snapshot
    assert not off.streaming and on.streaming
    assert "delta sync's" in on.reason and DeltaSender.memory_bytes(plan) == snapshot
    assert DeltaReceiver.memory_bytes(plan) == plan.bucket_count * plan.bucket_bytes


def test_a_session_runs_delta_sync_only_where_the_link_is_slower_than_the_host_work():
    m = build_manifest({f"w{i}": torch.zeros(2000, dtype=torch.bfloat16) for i in range(3)})
    plan = plan_buckets(m, 4096)
    assert not wanted("auto", "shm") and not wanted("auto", "ipc")  # memory speed: off
    assert wanted("auto", "broadcast") and wanted("on", "shm") and not wanted("off", "broadcast")
    assert host_reserve("auto", "shm", plan) == 0
    assert host_reserve("on", "shm", plan) == DeltaSender.memory_bytes(plan)


def test_an_encoded_version_moves_its_wire_lengths_and_rebuilds_the_version():
    m = build_manifest({f"w{i}": torch.zeros(2000, dtype=torch.bfloat16) for i in range(3)})
    plan = plan_buckets(m, 4096)
    sender, rx, model = DeltaSender(plan, m, "on"), DeltaReceiver(plan, m, "rollout-0"), _Model(m)
    versions = _versions(m, 2, 0.01)
    _run(sender, rx, model, 0, dict(versions[0]), [None])
    packer, record, digest = sender.prepare(1, dict(versions[1]), [0])
    version = VersionRecord(delta=record, digest=digest)
    # the transport moves the encoded lengths its record names, bucket for bucket
    assert [b.nbytes for b in version.moves(plan).buckets] == record.lengths == [b.nbytes for b in packer.plan.buckets]
    assert sum(record.lengths) < plan.payload_bytes
    rx.begin(1, record)
    got = []
    for b, wire in enumerate(_wire(packer)):
        pairs, rebuilt = rx.apply(1, record, b, wire)
        model.load(pairs)
        got.append(rebuilt)
    rx.committed(1)
    assert xxh3_version(got) == digest
    for n, t in versions[1].items():
        assert torch.equal(model.params[n].view(torch.uint8), t.view(torch.uint8)), n


def xxh3_version(digests: list[int]) -> str:
    from weightsync.digest import version_digest

    return version_digest("xxh3", digests)
