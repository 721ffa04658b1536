"""Adding a transport from outside the package: a ``toy`` transport, two small classes and one
``register()`` call, is accepted by the config, refused or taken by its own rules, and moves
versions bit-exactly between a sender and a receiver; no file of the package changes."""

from __future__ import annotations

import pytest
import torch
from support.parties import same_bits
from test_reset_cache import MANIFEST, run
from weightsync_bench.engine import ToyEngine

import weightsync.transports as transports
from weightsync import ConfigError, SyncConfig, WeightReceiver, WeightSender, records
from weightsync.digest import as_int, kind_of, version_digest
from weightsync.records import SessionRecord, VersionRecord
from weightsync.transports import (
    Bucket,
    Facts,
    ReceiverTransport,
    SenderTransport,
    Spans,
    Transport,
    TransportContext,
)

HANDED: dict = {}  # (session, version) -> [(bucket bytes, digest)]: versions handed over in this process's memory


class ToySender(SenderTransport):
    def __init__(self, ctx: TransportContext):
        self.ctx = ctx
        self.session = SessionRecord(digest_kind=kind_of(ctx.config, "cpu"))

    def stage(self, version, slot, packer):
        kind = self.session.digest_kind
        bufs = [torch.empty(b.nbytes, dtype=torch.uint8) for b in packer.plan.buckets]
        sums = [packer.fill(b, bufs[b], kind) for b in range(packer.plan.bucket_count)]
        HANDED[(self.ctx.session, version)] = list(zip(bufs, sums))
        return VersionRecord(digest=version_digest(kind, [as_int(s) for s in sums]) if kind else None)

    def send(self, version, deadline):
        return None

    def close(self):
        pass


class ToyReceiver(ReceiverTransport):
    def __init__(self, ctx: TransportContext, session: SessionRecord):
        self.ctx = ctx

    def receive(self, version, record, deadline):
        for b, (buf, digest) in enumerate(HANDED[(self.ctx.session, version)]):
            yield Bucket(b, buf, digest)

    def close(self):
        pass


def _refuses(f: Facts):
    return None if f.colocated else "transport 'toy' keeps to one process"


TOY = Transport("toy", ToySender, ToyReceiver, refuses=_refuses,
                auto=lambda f: (0, "auto: the toy, first wherever parties share a host device") if f.colocated else None)


@pytest.fixture
def toy():
    transports.register(TOY)
    yield
    transports.forget("toy")


def _placed(device: str = "cpu", node: str = "n1") -> records.Placement:
    return records.Placement(host="h", node_id=node, device=records.Device(type=device),
                             ipc=records.IpcSupport(ok=True, reason="host"))


def test_a_registered_transport_is_chosen_by_its_own_rules(toy):
    assert "toy" in transports.names() and SyncConfig(transport="toy").transport == "toy"
    # its auto rule ranks first where the parties share the host; its refusal names itself
    assert transports.choose("auto", _placed(), [_placed()]) == (
        "toy", "auto: the toy, first wherever parties share a host device")
    with pytest.raises(ConfigError, match="transport 'toy' keeps to one process"):
        transports.choose("toy", _placed(), [_placed(node="n2")])
    assert not isinstance(ToyReceiver(None, None), Spans), "an ability is there only where it is written"


def test_the_new_transport_moves_versions_bit_exactly(toy, coordinator_factory):
    cfg = {"transport": "toy", "bucket_mb": 1 / 16, "device": "cpu"}
    # the coordinator's process knows no toy (registered in this process only); it never
    # builds a transport, the parties here do
    coord = coordinator_factory({**cfg, "transport": "auto"})
    engine = ToyEngine(MANIFEST)
    receiver = WeightReceiver(coord, engine, name="local", config=SyncConfig.load(cfg))
    sender = WeightSender(coord, expected_receivers=1, config=SyncConfig.load(cfg))
    try:
        for v in (1, 2):
            weights, failed, errors = run(receiver, sender, v)
            assert failed is None and not errors and receiver.version == v
            assert all(same_bits(engine.params[n], w) for n, w in weights.items())
        assert coord.status().transport == "toy"
    finally:
        receiver.close()
        sender.close()
