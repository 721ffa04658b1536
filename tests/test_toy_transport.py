"""Adding a transport is one new folder: a ``toy`` transport written into a folder of the transports
package's path (here a temporary one beside it) is found by the catalog, accepted by the config,
refused or taken by its own rules, and moves versions bit-exactly between a sender and a receiver;
no file of the package changes."""

from __future__ import annotations

import textwrap

import pytest
from test_reset_cache import MANIFEST, run

import weightsync.transports as transports
from weightsync import ConfigError, SyncConfig, WeightReceiver, WeightSender, records
from weightsync.testing.parties import ToyEngine, same_bits
from weightsync.transports import catalog, selection

INIT = '''
"""A toy transport: versions handed over in this process's memory."""
from weightsync.transports.catalog import Facts, Transport


def _refuses(f: Facts):
    return None if f.colocated else "transport 'toy' keeps to one process"


TRANSPORT = Transport("toy", "weightsync.transports.toy.transport", "ToySender", "ToyReceiver", _refuses,
                      lambda f: (0, "auto: the toy, first wherever parties share a host device") if f.colocated else None)
'''

TRANSPORT = '''
"""The toy's ends: the sender packs each version into buckets of its own, the receiver reads them."""
import torch

from weightsync.digest import as_int
from weightsync.packing import Buffers
from weightsync.transports.base import ReceiverTransport, SenderTransport, VersionRecord

HANDED = {}  # (session, version) -> [(bucket bytes, digest)]


class ToySender(SenderTransport):
    name = "toy"

    def stage(self, version, slot, packing, announce):
        bufs = {}
        sink = Buffers(lambda b: bufs.setdefault(b, torch.empty(packing.plan.buckets[b].nbytes, dtype=torch.uint8)))
        for _ in packing.into(sink, self.digest_kind):
            pass
        sums = [as_int(sink.digests[b]) for b in sorted(bufs)] if self.digest_kind else []
        HANDED[(self.ctx.session, version)] = [(bufs[b], sums[b] if sums else None) for b in sorted(bufs)]
        return VersionRecord(digest=self._record(version, sums))


class ToyReceiver(ReceiverTransport):
    name = "toy"

    def receive(self, version, info, deadline, check):
        for b, (buf, digest) in enumerate(HANDED[(self.ctx.session, version)]):
            yield b, buf, digest
'''


@pytest.fixture
def toy(tmp_path, monkeypatch):
    folder = tmp_path / "toy"
    folder.mkdir()
    (folder / "__init__.py").write_text(textwrap.dedent(INIT))
    (folder / "transport.py").write_text(textwrap.dedent(TRANSPORT))
    monkeypatch.setattr(transports, "__path__", [*transports.__path__, str(tmp_path)])
    monkeypatch.setattr(catalog, "_found", False)  # the catalog looks at the folders again
    yield
    catalog.forget("toy")


def _placed(device: str = "cpu", node: str = "n1") -> records.Placement:
    return records.Placement(host="h", node_id=node, device=records.Device(type=device),
                             ipc=records.IpcSupport(ok=True, reason="host"))


def test_a_new_folder_is_a_transport_with_its_own_rules(toy):
    assert "toy" in transports.names() and SyncConfig(transport="toy").transport == "toy"
    # its auto rule ranks first where the parties share the host; its refusal names itself
    assert selection.choose_transport("auto", _placed(), [_placed()]) == (
        "toy", "auto: the toy, first wherever parties share a host device")
    with pytest.raises(ConfigError, match="transport 'toy' keeps to one process"):
        selection.choose_transport("toy", _placed(), [_placed(node="n2")])


def test_the_new_transport_moves_versions_bit_exactly(toy, coordinator_factory):
    cfg = {"transport": "toy", "bucket_mb": 1 / 16, "device": "cpu"}
    # the coordinator's process knows no toy (only this one's path has the folder); it never
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
