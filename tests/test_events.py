"""Each party logs one line per version through ``logging`` (weightsync/sender.py, weightsync/receiver.py): INFO when
it committed, WARNING naming the failure when it did not."""

from __future__ import annotations

import logging
import threading

import pytest
from weightsync_bench.engine import ToyEngine
from weightsync_bench.layouts import layout, materialize

from weightsync import WeightReceiver, WeightSender
from weightsync.manifest import plan_buckets, size_text

MANIFEST = layout("tiny")
CFG = {"transport": "shm", "bucket_mb": 1 / 16, "device": "cpu"}


def _lines(caplog, party: str) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "weightsync" and f" {party} v" in r.getMessage()]


def test_one_line_per_version_and_party_naming_the_failure(coordinator_factory, caplog):
    caplog.set_level(logging.INFO, logger="weightsync")
    coord = coordinator_factory(CFG)
    engine = ToyEngine(MANIFEST)
    fail = {"at": None}

    def load(pairs):
        if fail["at"] is not None:
            fail["at"] = None  # once: the rollback to version 1 loads
            raise RuntimeError("engine refused the weights")
        return engine.load_weights(pairs)

    receiver = WeightReceiver(coord, load, name="local", expected=engine.params)
    sender = WeightSender(coord, expected_receivers=1)
    try:
        for v in (1, 2):
            fail["at"] = 0 if v == 2 else None
            sender.stage(v, materialize(MANIFEST, seed=v))
            errors = []
            t = threading.Thread(target=_apply, args=(receiver, v, errors))
            t.start()
            if v == 1:
                sender.sync(v)
            else:
                with pytest.raises(Exception, match="engine refused the weights"):
                    sender.sync(v)
            t.join(60)
            assert not t.is_alive() and [type(e).__name__ for e in errors] == ([] if v == 1 else ["RuntimeError"])
    finally:
        receiver.close()
        sender.close()
    # a receiver's line: the bytes it received (the buckets, alignment padding included); the
    # sender's: the version's weights
    received = size_text(sum(b.nbytes for b in plan_buckets(MANIFEST, 1 << 16).buckets))
    size = size_text(MANIFEST.total_bytes)
    got_r, got_s = _lines(caplog, "local"), _lines(caplog, "trainer-0")
    assert [lvl for lvl, _ in got_r] == [logging.INFO, logging.WARNING], got_r
    assert got_r[0][1].startswith(f"receiver local v1 committed shm {received} ")
    assert got_r[1][1].startswith("receiver local v2 failed shm after 1/7 buckets ") and "engine refused the weights" in got_r[1][1]
    assert "rolled back to version 1" in got_r[1][1]
    assert [lvl for lvl, _ in got_s] == [logging.INFO, logging.WARNING], got_s
    assert got_s[0][1].startswith(f"sender trainer-0 v1 committed shm {size} stage ") and got_s[0][1].endswith("receivers local")
    assert got_s[1][1].startswith("sender trainer-0 v2 failed shm after ") and "local" in got_s[1][1]


def _apply(receiver, version, errors):
    try:
        receiver.apply(version)
    except Exception as exc:  # the failure under test; the sender's SyncFailed names it
        errors.append(exc)
