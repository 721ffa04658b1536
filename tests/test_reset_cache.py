"""The engine's cache reset is part of committing a version (WeightReceiver's reset_cache):
it runs after post-load and before the commit, once per version; a reset that raises or
returns False fails the version, which then rolls back like a failed load. An engine target
passed whole lends the receiver its hooks. Real vLLM: tests/vllm_gen."""

from __future__ import annotations

import threading

import pytest
from support.parties import same_bits
from weightsync_bench.engine import ToyEngine
from weightsync_bench.layouts import layout, materialize

from weightsync import SyncConfig, SyncFailed, WeightReceiver, WeightSender

CFG = {"transport": "shm", "bucket_mb": 1 / 16, "device": "cpu"}
MANIFEST = layout("tiny")


class CachingEngine(ToyEngine):
    """ToyEngine plus a cache whose reset can be made to fail; records the call order."""

    def __init__(self):
        super().__init__(MANIFEST)
        self.calls: list[str] = []
        self.reset_answer: object = True

    def load_weights(self, weights):
        self.calls.append("load")
        return super().load_weights(weights)

    def post_load(self) -> None:
        self.calls.append("post_load")

    def reset_cache(self):
        self.calls.append("reset")
        if isinstance(self.reset_answer, Exception):
            raise self.reset_answer
        return self.reset_answer


def run(receiver, sender, version):
    weights = materialize(MANIFEST, seed=version)
    sender.stage(version, weights)
    errors = []

    def apply():
        try:
            receiver.apply(version)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    t = threading.Thread(target=apply)
    t.start()
    try:
        sender.sync(version)
        failed = None
    except SyncFailed as exc:
        failed = exc
    t.join(60)
    return weights, failed, errors


@pytest.mark.parametrize("bad", [False, RuntimeError("cache busy")], ids=["returns-false", "raises"])
def test_a_failing_reset_fails_the_version_and_rolls_back(coordinator_factory, bad):
    coord = coordinator_factory(CFG)
    engine = CachingEngine()
    receiver = WeightReceiver(coord, engine, name="local", config=SyncConfig.load(CFG))  # the target whole
    sender = WeightSender(coord, expected_receivers=1, config=SyncConfig.load(CFG))
    try:
        first, failed, errors = run(receiver, sender, 1)
        assert failed is None and not errors and receiver.version == 1
        assert engine.calls[-2:] == ["post_load", "reset"] and engine.calls.count("reset") == 1
        engine.reset_answer = bad
        _, failed, errors = run(receiver, sender, 2)
        assert failed is not None and errors, "a failed reset committed the version"
        assert "reset" in str(errors[0]) or "cache busy" in str(errors[0]), errors
        # the rollback loads version 1's bytes again and resets again, which fails again here: the
        # engine's cache cannot be vouched for with either version, so it serves none until v3
        assert receiver.version is None and "serves no version" in str(failed), failed
        engine.reset_answer = True
        third, failed, errors = run(receiver, sender, 3)
        assert failed is None and not errors and receiver.version == 3
        assert all(same_bits(engine.params[n], w) for n, w in third.items())
    finally:
        receiver.close()
        sender.close()
