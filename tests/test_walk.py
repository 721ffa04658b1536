"""The path of one version, recounted from the code: the modules of the package that run while a
shm version goes from the sender's first ``stage`` to the receiver's commit, traced in the
parties' process (sender and receiver share it here; the coordinator is an actor of its own).
docs/design.md ("Following one version through the code") walks the same files; a module joining
the path fails this test until the walk says why."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

from test_reset_cache import MANIFEST, run
from weightsync_bench.engine import ToyEngine

from weightsync import SyncConfig, WeightReceiver, WeightSender

PKG = Path(__file__).resolve().parents[1] / "weightsync"

# docs/design.md's walk, in the parties' process; the coordinator's process adds
# coordinator/actor.py, and a vLLM engine integrations/vllm/weightsync_vllm/target.py
PARTIES = {"sender.py", "receiver.py", "manifest.py", "digest/__init__.py", "coordinator/client.py",
           "transports/__init__.py", "transports/shm/transport.py", "records.py", "config.py", "errors.py"}


def test_one_shm_version_runs_through_the_walk_and_nothing_else(coordinator_factory):
    cfg = {"transport": "auto", "bucket_mb": 1 / 16, "device": "cpu"}
    coord = coordinator_factory(cfg)
    engine = ToyEngine(MANIFEST)
    receiver = WeightReceiver(coord, engine, name="local", config=SyncConfig.load(cfg))
    sender = WeightSender(coord, expected_receivers=1, config=SyncConfig.load(cfg))
    seen: set[str] = set()

    def profile(frame, event, arg):
        path = frame.f_code.co_filename
        if event == "call" and path.startswith(str(PKG)):
            seen.add(str(Path(path).relative_to(PKG)))

    sys.setprofile(profile)
    threading.setprofile(profile)  # the receiver's own threads (its load, the segment's hashing) too
    try:
        _, failed, errors = run(receiver, sender, 1)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
        receiver.close()
        sender.close()
    assert failed is None and not errors and receiver.version == 1
    assert coord.status().transport == "shm"
    assert seen <= PARTIES, sorted(seen - PARTIES)
    # the walk is the path, not a list of everything: its main steps all ran here
    assert {"sender.py", "receiver.py", "manifest.py", "transports/shm/transport.py"} <= seen
