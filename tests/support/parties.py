"""Stand-ins for a trainer and a rollout worker, used by the tests. Real weightsync parties, real Ray
actors; only the model is a dict (weightsync_bench.engine.ToyEngine, the bench's engine too).

Fault points, so a test decides where a fault lands instead of betting on a sleep: a rollout
worker stops after loading bucket k of a version (``hold_at``), a trainer stops before
handing over tensor i (``stage(..., hold_at=i)``), and the test kills, stops or releases the
process from there (``reached`` / ``release``; the actor needs ``max_concurrency`` >= 2 so
those calls run beside the held one). A trainer can also corrupt or cut a bucket after it
was packed and checksummed, before receivers may read it (``tamper``), and a rollout can
flip a bit of its delta shadow (``corrupt_shadow``).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import torch
from weightsync_bench.engine import ToyEngine
from weightsync_bench.layouts import materialize

from weightsync import device as devices
from weightsync.config import SyncConfig
from weightsync.coordinator.client import Coordinator
from weightsync.manifest import Manifest
from weightsync.receiver import WeightReceiver
from weightsync.records import ReceiverMetrics
from weightsync.sender import SyncResult, WeightSender

from .faults import edit_packed, hold_receive, tampering


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality (NaN payloads and -0.0 included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


class Gate:
    """One fault point: the first thread to pass ``at`` signals ``reached`` and waits for ``release``."""

    HOLD_S = 120.0  # a test that never releases (it killed the process) must not leave a thread forever

    def __init__(self, *at: Any):
        self.at, self.reached, self.release = tuple(at), threading.Event(), threading.Event()

    def pass_(self, point: tuple) -> None:
        if point == self.at and not self.reached.is_set():
            self.reached.set()
            if not self.release.wait(self.HOLD_S):
                raise TimeoutError(f"fault point {self.at} was never released")


@dataclasses.dataclass(frozen=True)
class Counters:
    """What a rollout worker's engine counted, and its receiver's metrics of the last version."""

    loads: int  # load_weights calls
    post_loads: int  # post-load hook runs
    metrics: ReceiverMetrics | None  # WeightReceiver.last_metrics


class _Party:
    """What both stand-ins answer beside their role: their fault point's state, their process, close."""

    gate: Gate

    def _party(self) -> WeightReceiver | WeightSender:
        raise NotImplementedError

    def reached(self, timeout: float) -> bool:
        return self.gate.reached.wait(timeout)

    def release(self) -> None:
        self.gate.release.set()

    def pid(self) -> int:
        return os.getpid()

    def rss(self) -> int:
        # /proc rather than psutil: psutil comes with the bench extra, the stand-ins without it
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def close(self) -> None:
        self._party().close()


class RolloutWorker(_Party):
    """A rollout worker: one receiver feeding a ToyEngine. Wrap with ``ray.remote``."""

    def __init__(self, coordinator: Coordinator, manifest_wire: list, name: str, rank: int = 0,
                 config: dict | None = None, check: bool = True, expected_wire: list | None = None,
                 load_delay_s: float = 0.0, device: str = "cpu", batched: bool = False):
        manifest = Manifest.from_wire(manifest_wire)
        model = Manifest.from_wire(expected_wire) if expected_wire is not None else manifest
        self.engine = ToyEngine(model, device=device, load_delay_s=load_delay_s)
        cfg = SyncConfig.load(config) if config is not None else None
        # batched: the engine loads through weightsync.CopyInto (one batched copy per bucket)
        self.receiver = WeightReceiver(
            coordinator, self.engine.copy_in if batched else self.engine.load_weights, name=name, rank=rank,
            post_load=self.engine.post_load,
            expected={s.name: s for s in model} if check else None, config=cfg,
        )
        self.gate = Gate()

    def apply(self, version: int | None = None, timeout: float | None = None, wait: bool = True) -> int | None:
        if self.gate.at:
            # the fault point sits on the session's transport: open it first, as apply() does
            # before anything else, so a hold on the first version lands too
            self.receiver._ensure_session(self.receiver.config.connect_timeout_s)
            hold_receive(self.receiver, lambda point: self.gate.pass_(point))
        return self.receiver.apply(version, timeout=timeout, wait=wait)

    def hold_at(self, version: int, bucket: int) -> None:
        """Fault point: once bucket ``bucket`` of ``version`` is loaded, apply() waits for
        release() (faults.hold_receive: the receiver's view of its transport, installed at
        the next apply())."""
        self.gate = Gate(version, bucket)

    def corrupt_shadow(self, bucket: int, offset: int) -> None:
        """Fault in host memory: flip one bit of byte ``offset`` of bucket ``bucket`` in the
        receiver's delta shadow (a bit flip, a stray write), where nothing checks it until
        the next delta version rebuilds that bucket."""
        self.receiver.shadow.bucket(bucket)[offset] ^= 0x40

    def prefetch(self, version: int | None = None) -> int | None:
        return self.receiver.prefetch(version)

    def version(self) -> int | None:
        return self.receiver.version

    def weights(self) -> dict[str, torch.Tensor]:
        return {n: t.cpu().clone() for n, t in self.engine.params.items()}

    def counters(self) -> Counters:
        return Counters(self.engine.loads, self.engine.post_loads, self.receiver.last_metrics)

    def _party(self) -> WeightReceiver:
        return self.receiver


class TrainerWorker(_Party):
    """A trainer rank whose weights for version v are ``materialize(manifest, seed=v)``."""

    def __init__(self, coordinator: Coordinator, manifest_wire: list, rank: int = 0,
                 config: dict | None = None, expected_receivers: int | None = None, device: str = "cpu"):
        self.manifest, self.device = Manifest.from_wire(manifest_wire), str(devices.resolve(device))
        cfg = SyncConfig.load(config) if config is not None else None
        self.sender = WeightSender(coordinator, rank=rank, config=cfg, expected_receivers=expected_receivers)
        self.gate = Gate()

    def stage(self, version: int, seed: int | None = None, delay_s: float = 0.0,
              named: list | None = None) -> float:
        """Stage the weights of ``version``. ``delay_s`` slows the tensor iteration (a trainer
        still gathering), ``named`` replaces the tensors (bad-input tests)."""
        tensors = named if named is not None else materialize(self.manifest, seed=version if seed is None else seed,
                                                              device=self.device)
        if delay_s:
            items = tensors.items() if isinstance(tensors, dict) else tensors
            tensors = ((n, t) for n, t in items if time.sleep(delay_s) is None)
        if self.gate.at:
            gate, items = self.gate, tensors.items() if isinstance(tensors, dict) else tensors
            tensors = ((n, t) for i, (n, t) in enumerate(items) if gate.pass_((i,)) is None)
        return self.sender.stage(version, tensors).wait()

    def hold_at(self, tensor: int) -> None:
        """Fault point: the next tensor iteration stops before tensor ``tensor`` until
        release(). Transports that pack at the barrier (ipc, broadcast) iterate in sync(),
        so the hold lands there."""
        self.gate = Gate(tensor)

    def tamper(self, version: int, bucket: int, how: str) -> None:
        """Fault point on the wire: once bucket ``bucket`` of ``version`` is packed and its
        checksum taken, flip one byte of it (``corrupt``) or zero its second half, as a short
        write leaves it (``truncate``), before any receiver may read it (faults.edit_packed,
        on the session's transport: the trainer staged a version before)."""
        edit_packed(self.sender.transport, tampering(version, bucket, how))

    def sync(self, version: int, timeout: float | None = None) -> SyncResult:
        return self.sender.sync(version, timeout=timeout)

    def step(self, version: int, seed: int | None = None) -> SyncResult:
        self.stage(version, seed)
        return self.sync(version)

    def delta_state(self) -> dict[str, Any] | None:
        return self.sender.delta_state()

    def _party(self) -> WeightSender:
        return self.sender


def differing(got: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]) -> list[str]:
    """The names of ``expected`` that ``got`` lacks or holds with other bits."""
    return [n for n in expected if n not in got or not same_bits(got[n], expected[n])]


def assert_same_weights(got: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor], what: str = "") -> None:
    """``got`` holds every tensor of ``expected`` bit for bit (``what`` names the case in the failure)."""
    bad = differing(got, expected)
    assert not bad, f"{what + ': ' if what else ''}{len(bad)} tensors differ after transfer, e.g. {bad[:3]}"


def check_serves(rollout: Any, expected: Manifest | Mapping[str, torch.Tensor],
                 timeout: float = 60.0) -> tuple[int | None, list[str]]:
    """(the version ``rollout`` serves, the tensors of its engine that differ from ``expected``,
    bit for bit). ``rollout``: a :class:`RolloutWorker` Ray actor. ``expected``: the weights
    it must hold, or a manifest, whose version v weights are ``materialize(manifest, seed=v)``
    as :class:`TrainerWorker` stages them."""
    import ray

    served = ray.get(rollout.version.remote(), timeout=timeout)
    if served is None:
        return None, []
    if isinstance(expected, Manifest):
        expected = materialize(expected, seed=served)
    return served, differing(ray.get(rollout.weights.remote(), timeout=timeout), expected)


def serves(rollout: Any, expected: Manifest | Mapping[str, torch.Tensor], timeout: float = 60.0) -> int | None:
    """The version ``rollout`` serves, once its weights are shown to be exactly ``expected``."""
    served, bad = check_serves(rollout, expected, timeout)
    assert not bad, f"rollout claims version {served} but {len(bad)} tensors differ, e.g. {bad[:3]}"
    return served


def assert_serves(rollout: Any, expected: Manifest | Mapping[str, torch.Tensor], version: int | None,
                  timeout: float = 60.0) -> None:
    """``rollout`` serves ``version`` and holds exactly ``expected`` (a manifest: that version's
    weights; None: serves nothing)."""
    served = serves(rollout, expected, timeout)
    assert served == version, f"rollout serves version {served}, expected {version}"


# -- a job: a coordinator, N rollout workers and a trainer, all real Ray actors --------------

# fast failure detection for tests; device cpu unless a test asks for one: on a GPU node "auto"
# would pick cuda for some parties (those Ray gives a GPU, or all of them) and not others
JOB_DEFAULTS = {"heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 2.0, "sync_timeout_s": 60.0,
                "connect_timeout_s": 60.0, "device": "cpu"}
# A party on the simulated device runs each of its streams as a Python thread of its own process; under
# load (two test workers on 2 cores, venvs building beside them) they starved a healthy party's heartbeat
# thread for 2.2 s in a first version. Its jobs get a looser bound; a lost party is still named by it.
SIM_HEARTBEAT_TIMEOUT_S = 5.0


def job_config(config: dict | None = None) -> dict:
    """``JOB_DEFAULTS`` under ``config``, with the simulated device's liveness bound where it runs."""
    config = config or {}
    sim = {"heartbeat_timeout_s": SIM_HEARTBEAT_TIMEOUT_S} if config.get("device") == "sim" else {}
    return {**JOB_DEFAULTS, **sim, **config}


_job_ids = itertools.count()


def wait_until(what: str, cond: Any, timeout: float = 30.0, interval: float = 0.05, *, strict: bool = True) -> Any:
    """Poll ``cond()`` until it is truthy and return its value; a state a party or the
    coordinator reports, never time passing. A call that raises counts as not yet (a
    restarting coordinator answers nothing for a while). TimeoutError names ``what``;
    ``strict=False`` returns the last (falsy) value instead, for a caller whose own
    assertion then says what was left."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            got = cond()
        except Exception:
            got = None
        if got:
            return got
        if time.monotonic() > deadline:
            if not strict:
                return got
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting until {what}")
        time.sleep(interval)


def new_coordinator(config: dict | None = None, prefix: str = "ws-test", **kwargs: Any) -> Coordinator:
    """A coordinator under a name no other job on the cluster has, configured by ``job_config(config)``."""
    return Coordinator.create(job_config(config), name=f"{prefix}-{os.getpid()}-{next(_job_ids)}",
                              **kwargs)


def rollout_actor(coordinator: Coordinator, manifest: Manifest, name: str, rank: int = 0, config: dict | None = None,
                  options: dict | None = None, cls: type | None = None, **kwargs: Any) -> Any:
    """A :class:`RolloutWorker` (or subclass ``cls``) Ray actor (``options``: Ray's, e.g. device resources)."""
    import ray

    return ray.remote(cls or RolloutWorker).options(**{"num_cpus": 0, **(options or {})}).remote(
        coordinator, manifest.to_wire(), name, rank=rank, config=config, **kwargs)


def trainer_actor(coordinator: Coordinator, manifest: Manifest, config: dict | None = None,
                  receivers: int | None = None, options: dict | None = None, cls: type = TrainerWorker,
                  **kwargs: Any) -> Any:
    """A :class:`TrainerWorker` (or subclass ``cls``) Ray actor expecting ``receivers`` receivers."""
    import ray

    return ray.remote(cls).options(**{"num_cpus": 0, **(options or {})}).remote(
        coordinator, manifest.to_wire(), config=config, expected_receivers=receivers, **kwargs)


class Job(NamedTuple):
    coordinator: Coordinator
    rollouts: list  # RolloutWorker actors named rollout-<rank>
    trainer: Any  # the sending TrainerWorker actor

    @property
    def parties(self) -> list:
        return [*self.rollouts, self.trainer]

    def step(self, version: int, seed: int | None = None, timeout: float = 120.0) -> tuple[list, SyncResult]:
        """Every rollout applies ``version`` while the trainer stages and syncs it: (the versions
        the rollouts applied, the trainer's sync result)."""
        import ray

        applied = [r.apply.remote(version) for r in self.rollouts]
        result = ray.get(self.trainer.step.remote(version, seed), timeout=timeout)
        return ray.get(applied, timeout=timeout), result

    def run(self, manifest: Manifest, versions: Iterable[int], timeout: float = 120.0) -> None:
        """Each of ``versions`` in turn: every rollout applies it and serves it bit-exactly."""
        for v in versions:
            assert self.step(v, timeout=timeout)[0] == [v] * len(self.rollouts)
            for r in self.rollouts:
                assert_serves(r, manifest, v, timeout)


def start_parties(coordinator: Coordinator, manifest: Manifest, config: dict | None = None, receivers: int = 2, *,
                  options: dict | None = None, rollout: dict | None = None, trainer: dict | None = None) -> Job:
    """``receivers`` rollout workers (rollout-0, ...) and a trainer (rank 0) on ``coordinator``,
    all started at once; ``rollout`` / ``trainer``: more arguments for each side's actor."""
    rs = [rollout_actor(coordinator, manifest, f"rollout-{i}", i, config, options, **(rollout or {}))
          for i in range(receivers)]
    return Job(coordinator, rs, trainer_actor(coordinator, manifest, config, receivers, options, **(trainer or {})))


def stop_actors(handles: Iterable[Any], timeout: float = 10.0) -> None:
    """Close each actor where it still answers, then kill it (teardown: errors are not the test's)."""
    import ray

    for handle in handles:
        try:
            ray.get(handle.close.remote(), timeout=timeout)
        except Exception:
            pass
        ray.kill(handle)
