"""One job for a module's fault tests: a coordinator, two rollout workers and a trainer, all
real Ray actors, kept across the module's tests (starting processes is most of a fault
test's time). Each test begins with ``fresh()``: every party alive and serving the job's
newest version, whatever the test before it killed, stopped or corrupted.

Faults land where the test puts them, never where a sleep guesses: the parties stop at a
fault point (support.parties: a rollout after loading bucket k, a trainer before tensor
i) and say so; the test acts there. Waits in here wait for a state the coordinator reports
(a party seen dead, a version aborted), with a deadline, not for time to pass.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import pytest
import ray
from support.parties import (
    RolloutWorker,
    job_config,
    new_coordinator,
    rollout_actor,
    serves,
    stop_actors,
    trainer_actor,
)
from support.parties import wait_until as _wait_until

from weightsync import SyncFailed
from weightsync.device import ray_options
from weightsync.manifest import Manifest, plan_buckets
from weightsync.records import Metrics, PartyStatus

# threaded actors: reached() / release() run beside an apply() or stage() held at a fault point
THREADED = {"max_concurrency": 4}
DEADLINE_S = 30.0  # sync_timeout_s: every failure must surface well before it
RECEIVERS = ("rollout-0", "rollout-1")


def wait_until(what: str, cond, timeout: float = DEADLINE_S, **kwargs: Any) -> Any:
    """support.parties.wait_until with this job's deadline."""
    return _wait_until(what, cond, timeout, **kwargs)


def sim_env(physical: int, lag_ms: float = 20.0, seed: int = 1) -> dict:
    """Ray options for a party on the simulated accelerator (tests/sim/weightsync_sim): its
    events complete up to ``lag_ms`` late; ``physical``: which simulated device it holds."""
    return {"runtime_env": {"env_vars": {"SIMDEV_LAG_MS": str(lag_ms), "SIMDEV_SEED": str(seed),
                                         "SIMDEV_VISIBLE_DEVICES": str(physical)}}}


@dataclasses.dataclass(frozen=True)
class Queued:
    """On the sim device: ops queued so far on the stream a rollout worker's calls run on (the
    engine's loads), and on its receiver's receive-ahead stream (None: none)."""

    engine: int
    ahead: int | None
    same: bool  # the ahead stream is the engine's


class SimRolloutWorker(RolloutWorker):
    """A rollout worker on the sim device that also tells what was queued on which stream."""

    def sim_queued(self) -> Queued:
        import weightsync_sim as sim

        copy = self.receiver.transport.copy  # the broadcast receiver's ahead copy, once it took a version
        ahead = copy.stream if copy is not None else None
        engine = sim.current_stream()
        return Queued(engine.mark(), None if ahead is None else ahead.mark(), ahead is engine)


class Job:
    def __init__(self, transport: str, manifest: Manifest, bucket_mb: float, *,
                 coordinator_options: dict | None = None, device: str = "cpu", **extra: Any):
        """``device="sim"``: every party on the simulated accelerator, one device for all (ipc,
        shm) or one each (broadcast: a device collective holds a device once)."""
        self.transport, self.manifest, self.device = transport, manifest, device
        self.cfg = job_config({"transport": transport, "bucket_mb": bucket_mb, "sync_timeout_s": DEADLINE_S,
                               "device": device, **extra})
        self.coord = new_coordinator(self.cfg, "ws-faults", actor_options=coordinator_options)
        self.buckets = plan_buckets(manifest, int(bucket_mb * 2**20), 256).bucket_count
        self.actors: list[Any] = []
        self.rollouts: dict[str, Any] = {}
        self.dead: set[str] = set()
        self.v = 0
        # every process starts at once (each takes seconds to import torch), then all register
        for rank, name in enumerate(RECEIVERS):
            self.rollouts[name] = self._start_rollout(name, rank)
        self.trainer = self._start_trainer()
        ray.get([r.version.remote() for r in self.rollouts.values()], timeout=120)

    # -- parties ----------------------------------------------------------------------

    def _options(self, physical: int) -> tuple[dict, dict]:
        """(Ray options, actor arguments) of a party."""
        if self.device == "cpu":
            return THREADED, {}
        if self.device == "sim":
            return {**THREADED, **sim_env(physical if self.transport == "broadcast" else 0)}, {"device": "sim"}
        # a real accelerator: every party on one device (fractions of it), the colocated case
        return {**THREADED, **ray_options(self.device, 1 / (len(RECEIVERS) + 1))}, {"device": self.device}

    def _start_rollout(self, name: str, rank: int) -> Any:
        options, kwargs = self._options(rank + 1)
        cls = SimRolloutWorker if self.device == "sim" else None
        actor = rollout_actor(self.coord, self.manifest, name, rank, self.cfg, options, cls=cls, **kwargs)
        self.actors.append(actor)
        return actor

    def _start_trainer(self) -> Any:
        options, kwargs = self._options(0)
        actor = trainer_actor(self.coord, self.manifest, self.cfg, len(RECEIVERS), options, **kwargs)
        self.actors.append(actor)
        return actor

    def kill(self, name: str) -> None:
        ray.kill(self.trainer if name == "trainer" else self.rollouts[name])
        self.dead.add(name)

    def restart(self, name: str) -> Any:
        """A replacement for a killed party. A rollout has registered when this returns: a
        streaming transport sends a version to the receivers registered at the barrier."""
        if name == "trainer":
            self.trainer = self._start_trainer()
            ray.get(self.trainer.pid.remote(), timeout=120)
        else:
            self.rollouts[name] = self._start_rollout(name, RECEIVERS.index(name))
            ray.get(self.rollouts[name].version.remote(), timeout=120)
        self.dead.discard(name)
        return self.trainer if name == "trainer" else self.rollouts[name]

    def party(self, name: str) -> PartyStatus | None:
        found = [p for p in self.coord.status().parties if p.name == name]
        return found[-1] if found else None

    def wait_seen(self, name: str, alive: bool) -> None:
        wait_until(f"the coordinator sees {name} {'alive' if alive else 'dead'}",
                   lambda: getattr(self.party(name), "alive", None) is alive)

    # -- versions ---------------------------------------------------------------------

    def next(self) -> int:
        self.v += 1
        return self.v

    def fresh(self) -> int:
        """Every party alive and serving a new committed version; returns it."""
        for name in sorted(self.dead):
            self.restart(name)
        v = self.next()
        assert self.step(v) == {n: v for n in RECEIVERS}
        return v

    def step(self, version: int, names=RECEIVERS) -> dict[str, int]:
        applied = {n: self.rollouts[n].apply.remote(version) for n in names}
        ray.get(self.trainer.step.remote(version), timeout=120)
        return {n: ray.get(ref, timeout=60) for n, ref in applied.items()}

    def start_held(self, version: int, bucket: int, sync_timeout: float | None = None) -> tuple[dict[str, Any], Any]:
        """Every rollout stops after loading ``bucket`` of ``version`` (a fault point it
        signals); the trainer stages and syncs the version. Returns (each rollout's apply
        ref, the trainer's sync ref) once every rollout stands at that point."""
        ray.get([r.hold_at.remote(version, bucket) for r in self.rollouts.values()])
        ray.get(self.trainer.stage.remote(version))
        applied = {n: r.apply.remote(version) for n, r in self.rollouts.items()}
        sync = self.trainer.sync.remote(version, sync_timeout)
        assert all(ray.get([r.reached.remote(DEADLINE_S) for r in self.rollouts.values()]))
        return applied, sync

    def bucket_at(self, where: str) -> int:
        """The bucket a fault lands after: "first", "middle" or "last" of a version."""
        return {"first": 0, "middle": self.buckets // 2, "last": self.buckets - 1}[where]

    def kill_held(self, name: str, where: str) -> tuple[int, int, dict[str, Any], Any]:
        """From a fresh job, a new version held after its ``where`` bucket (start_held()) and
        ``name`` (a rollout or "trainer") killed there; once the coordinator has seen it (a
        receiver failed in the version, or the version aborted for a sender), the other rollouts
        go on. Returns (the version served before, the new one, start_held()'s refs)."""
        base, version = self.fresh(), self.next()
        applied, sync = self.start_held(version, self.bucket_at(where))
        self.kill(name)
        if name == "trainer":
            wait_until("the coordinator aborted v", lambda: self.state(version) == "ABORTED")
        else:
            wait_until(f"{name} is failed in v", lambda: name in self.metrics(version).failed)
        ray.get([r.release.remote() for n, r in self.rollouts.items() if n != name])
        return base, version, applied, sync

    def next_serves_all(self, restart: str | None = None) -> bool:
        """A new version commits on every receiver and each serves it, bit-exactly (after a
        replacement for the killed party ``restart``, where one is named)."""
        if restart:
            self.restart(restart)
        v = self.next()
        return self.step(v) == {n: v for n in RECEIVERS} and [self.serves(n) for n in RECEIVERS] == [v, v]

    def metrics(self, version: int) -> Metrics:
        return self.coord.metrics(version)

    def state(self, version: int) -> str:
        return self.metrics(version).state

    def serves(self, name: str) -> int | None:
        """The version ``name`` serves; checks its weights are exactly that version's, bit for bit."""
        return serves(self.rollouts[name], self.manifest)

    def close(self) -> None:
        stop_actors(self.actors)
        self.coord.shutdown()


def sync_failed(ref) -> SyncFailed:
    """The sender's sync fails, within the deadline, with a SyncFailed."""
    t0 = time.monotonic()
    with pytest.raises(SyncFailed) as err:
        ray.get(ref, timeout=DEADLINE_S + 30)
    assert time.monotonic() - t0 < DEADLINE_S, "the failure surfaced before the deadline"
    return err.value


def survivor_commits(job: Job, version: int, applied, sync, why: str) -> None:
    """The sender's sync (ref ``sync``) fails naming only rollout-1 (its reason says ``why``);
    rollout-0 (its apply ref ``applied``) commits ``version`` and serves it; the version ABORTED."""
    err = sync_failed(sync)
    assert set(err.failed) == {"rollout-1"} and why in err.failed["rollout-1"], err
    assert err.committed == ["rollout-0"] and job.state(version) == "ABORTED"
    assert ray.get(applied) == version and job.serves("rollout-0") == version


def apply_fails(ref, *patterns: str) -> str:
    """A receiver's apply() fails; its error says each of ``patterns``."""
    with pytest.raises(ray.exceptions.RayTaskError) as err:
        ray.get(ref, timeout=DEADLINE_S + 30)
    text = str(err.value)
    for p in patterns:
        assert p in text, f"{p!r} not in the receiver's error: {text[-800:]}"
    return text
