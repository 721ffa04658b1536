"""Internal. Runs the benchmark rows: weightsync transports, Ray object store baselines and collective
baselines, all between the same trainer and rollout actors, over the same bytes.

One version's time is the wall time from the start of ``stage()`` on the trainer to the
last receiver's commit, with every receiver's ``apply()`` already waiting (so pipelined
transports overlap staging and reading, as they do in a job). The pre-staged barrier is
timed separately: the version is staged first, then ``sync()`` + ``apply()`` are timed,
which is what the trainer waits for at the barrier when staging overlapped generation.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import itertools
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import ray

from weightsync import transports
from weightsync.coordinator.client import Coordinator
from weightsync.device import ray_options
from weightsync.manifest import Manifest

from .actors import BenchRollout, BenchTrainer
from .delta_rows import delta_suffix
from .fixed_cost import FIXED_COST, add_version, medians, new_samples
from .interrupt import Progress, asked, check, interrupt_close, tick
from .rowkit import ROW_TIMEOUT_S, describe_error, devices_short, one_device_per_rank

__all__ = ["ROW_TIMEOUT_S", "Bench", "describe_error", "devices_short", "one_device_per_rank", "transport_unavailable"]

def stats(seconds: list[float]) -> dict[str, float]:
    if not seconds:
        return {"median_s": float("nan"), "p90_s": float("nan"), "min_s": float("nan")}
    return {"median_s": statistics.median(seconds), "p90_s": float(np.percentile(seconds, 90)),
            "min_s": min(seconds)}


def transport_unavailable(name: str, backend: str, device: str) -> str | None:
    """None if ``name`` can run here, else why not (a transport module may be missing)."""
    if name == "auto":
        return None
    if name not in transports.names():
        return f"transport {name!r} is not registered in this build ({', '.join(transports.names())})"
    if name == "broadcast" and backend == "nccl" and device != "cuda":
        return "backend nccl needs --device cuda"
    if name == "broadcast" and backend == "hccl" and device != "npu":
        return "backend hccl needs --device npu"
    return None


class Bench:
    """Owns the actors for one benchmark run; each ``*_row`` method returns one result row."""

    def __init__(self, manifest: Manifest, *, receivers: int, device: str = "cpu", weights_path: str | None = None,
                 versions: int = 5, warmup: int = 1, barrier_versions: int | None = None, progress: bool = True,
                 check: bool = True,
                 runtime_env: dict[str, Any] | None = None, classes: tuple[type, type] | None = None,
                 coordinator: Callable[[dict, str], Any] | None = None,
                 update: str = "random", rdt: tuple[str, ...] = (), keep_baselines: frozenset[str] = frozenset(),
                 groups: tuple[tuple[str, str], ...] = (), fixed_cost: bool = False, device_share: float = 0.5):
        """``rdt``: Ray Direct Transport baselines whose actors start now, beside this bench's own
        (rdt_rows.RdtPair). ``keep_baselines``: whose own actors ("rdt": RDT pairs, "groups":
        collective groups) stay from their first round to the last; the others' rows make and end their own,
        so the memory they hold never shrinks what the shm rows may use (shm.transport.budget
        picks a streaming ring, another mode, when the node has too little free). ``groups``:
        (collective baseline, backend) whose kept group starts now too (baseline_rows.start).
        ``fixed_cost``: its sync rows are fixed-cost rows (fixed_cost.py): only pre-staged
        barriers are timed, none after prefetch(). ``device_share``: the part of one device its
        parties ask Ray for together (on an accelerator)."""
        self.manifest = manifest
        # only passed when not the default: an --against side's older BenchTrainer has no such argument
        self._update = {"update": update} if update != "random" else {}
        self.interrupted = False  # Ctrl-C: tear down without waiting on busy actors
        self.payload = manifest.total_bytes
        self.device = device
        self.versions, self.warmup = versions, warmup
        # pre-staged barriers per sync row (every other one after prefetch()); 2 x versions before presets
        self.barrier_versions = 2 * versions if barrier_versions is None else barrier_versions
        self.check = check
        self.fixed_cost = fixed_cost
        self.progress = Progress(progress)
        self._version = itertools.count(1)
        self._ids = itertools.count()
        parties = receivers + 1
        # runtime_env, classes, coordinator: an A/B run's other side, actors (and the coordinator
        # they talk to) running another checkout's code
        self._classes = classes or (BenchTrainer, BenchRollout)
        self._coordinator = coordinator or (lambda config, name: Coordinator.create(config, name=name))
        self._base: dict[str, Any] = {"num_cpus": 0, "max_concurrency": 1,
                                      **({"runtime_env": runtime_env} if runtime_env else {})}
        # colocated on one device, like the ipc case; half of it by default, so that the Ray Direct
        # Transport rows' own colocated actors (rdt_rows: CUDA_IPC) fit on the same device beside them
        self._share = device_share / parties
        self._opts, self._weights_path = {**self._base, **ray_options(device, self._share)}, weights_path
        self._spread: tuple[Any, list[Any]] | None = None  # one device per party, made when needed
        self._rdt: dict[str, Any] = {}  # RDT baseline name -> its RdtPair, made on its first row
        # the collective baselines' groups, kept from their first round to the last (baseline_rows.run)
        self._groups: dict[tuple, list[Any]] = {}
        self.keep_baselines = keep_baselines
        from . import baseline_rows, rdt_rows

        for name in rdt:
            self._rdt[name] = rdt_rows.pair_for(self, name, receivers)
        early = [baseline_rows.start(self._groups, manifest, kind, receivers, backend, device) for kind, backend in groups]
        self.trainer = self._new_trainer()
        self.rollouts = [self._new_rollout(i) for i in range(receivers)]
        self.pids = ray.get([self.trainer.pid.remote()] + [r.pid.remote() for r in self.rollouts])
        for thread in early:  # nothing is timed while they make their version
            thread.join()

    def _new_trainer(self, opts: dict[str, Any] | None = None) -> Any:
        return ray.remote(self._classes[0]).options(**(opts or self._opts)).remote(self.manifest.to_wire(), self.device,
                                                                               self._weights_path, **self._update)

    def _new_rollout(self, i: int, opts: dict[str, Any] | None = None) -> Any:
        return ray.remote(self._classes[1]).options(**(opts or self._opts)).remote(
            self.manifest.to_wire(), f"bench-rollout-{i}", i + 1, self.device)

    def _parties(self, spread: bool) -> tuple[Any, list[Any]]:
        """The trainer and rollouts of a row: all on one device (the ipc case), or for a
        device collective each on a device of its own (made on first use, then kept)."""
        if not spread:
            return self.trainer, self.rollouts
        if self._spread is None:
            opts = {**self._base, **ray_options(self.device, 1)}
            trainer = self._new_trainer(opts)
            rollouts = [self._new_rollout(i, opts) for i in range(len(self.rollouts))]
            self.pids += ray.get([trainer.pid.remote()] + [r.pid.remote() for r in rollouts], timeout=ROW_TIMEOUT_S)
            self._spread = (trainer, rollouts)
        return self._spread

    def revive(self) -> list[str]:
        """Replace actors that died (e.g. killed by Ray's memory monitor), so one failed row
        does not fail every row after it. Returns who was replaced."""
        replaced = []

        def alive(actor: Any) -> bool:
            try:
                ray.get(actor.pid.remote(), timeout=120)
                return True
            except Exception:
                with contextlib.suppress(Exception):
                    ray.kill(actor)
                return False

        if not alive(self.trainer):
            self.trainer = self._new_trainer()
            replaced.append("trainer")
            self.pids.append(ray.get(self.trainer.pid.remote()))  # for a Ctrl-C later: every process to wait for
        for i, r in enumerate(self.rollouts):
            if not alive(r):
                self.rollouts[i] = self._new_rollout(i)
                replaced.append(f"rollout-{i}")
                self.pids.append(ray.get(self.rollouts[i].pid.remote()))
        return replaced

    # -- helpers -----------------------------------------------------------------------

    def _row(self, **fields: Any) -> dict[str, Any]:
        row = {"kind": "transport", "name": "", "transport": None, "backend": None, "bucket_mb": None,
               "receivers": None, "payload_bytes": self.payload, "versions": 0, "seconds": [],
               "median_s": None, "p90_s": None, "min_s": None, "gbps": None, "stage_s": None,
               "barrier_s": None, "prestaged_s": [], "prefetched_barrier_s": None, "prefetched_s": [],
               "sender_peak_extra_bytes": None,
               "receiver_peak_extra_bytes": None, "receivers_peak_extra_bytes": [], "shm_bytes": None, "phases_s": {}, "verified": None,
               "checksum": None, "delta": None, "changed_fraction": [], "calls_per_version": {}, "error": None}
        row.update(fields)
        return row

    def _finish(self, row: dict[str, Any], seconds: list[float]) -> dict[str, Any]:
        row["seconds"] = seconds
        row["versions"] = len(seconds)
        row.update(stats(seconds))
        # a fixed-cost row's bytes are next to none: its GB/s would only restate its seconds
        fixed = row["kind"] == FIXED_COST
        row["gbps"] = self.payload / row["median_s"] / 1e9 if seconds and row["median_s"] > 0 and not fixed else None
        return row

    def _verify(self, rollouts: list, trainer: Any = None) -> bool:
        if not self.check:
            return None
        want = ray.get((trainer or self.trainer).digest.remote())
        got = ray.get([r.digest.remote() for r in rollouts])
        return all(g == want for g in got)

    @property
    def rdt_made(self) -> set[str]:
        """The RDT baselines whose actors exist (their models are already in the node's memory)."""
        return set(self._rdt)

    def close(self) -> None:
        import psutil

        spread = [self._spread[0], *self._spread[1]] if self._spread else []
        procs = []
        if self.interrupted or asked():  # busy actors answer nothing: kill them, then reap their segment files
            interrupt_close([self.trainer, *self.rollouts, *spread, *(a for p in self._rdt.values() for a in p.actors),
                             *(a for g in self._groups.values() for a in g)],
                            self.pids + [pid for p in self._rdt.values() for pid in p.pids])
            return
        for pair in self._rdt.values():
            pair.close()
        from . import baseline_rows

        baseline_rows.close(self._groups)
        for actor in [self.trainer, *self.rollouts, *spread]:
            with contextlib.suppress(Exception):
                procs.append(psutil.Process(ray.get(actor.pid.remote(), timeout=30)))
            with contextlib.suppress(Exception):
                ray.get(actor.close.remote(), timeout=30)
            with contextlib.suppress(Exception):
                ray.kill(actor)
        # ray.kill returns before the worker exits: the next size's memory check (and its
        # models) must not count this size's copies still being torn down
        psutil.wait_procs(procs, timeout=60)

    # -- weightsync transports -----------------------------------------------------------

    def sync_row(self, transport: str, bucket_mb: float, receivers: int, backend: str = "auto",
                 checksum: bool = True, digest: str = "auto", delta: str = "off") -> dict[str, Any]:
        suffix = ("" if not checksum or digest == "auto" else f" ({digest} digest)") + delta_suffix(delta)
        name = (transport if checksum else f"{transport} (no digest)") + suffix
        if self.fixed_cost:
            suffix += f" {FIXED_COST}"
            name += f" {FIXED_COST}"
        row = self._row(kind=FIXED_COST if self.fixed_cost else "transport", name=name, transport=transport,
                        backend=backend, bucket_mb=bucket_mb, receivers=receivers, checksum=checksum, digest=digest if checksum else "off", delta=delta)
        spread = transport == "broadcast" and one_device_per_rank(backend, self.device)
        # the set made for the first such row serves every receiver count of the run
        why = transport_unavailable(transport, backend, self.device) or (
            devices_short(self.device, backend, len(self.rollouts) + 1) if spread and self._spread is None else None)
        if why:
            row.update(kind="unavailable", error=why)
            return row
        trainer, pool = self._parties(spread)
        rx = pool[:receivers]
        cfg = {"transport": transport, "backend": backend, "device": self.device, "bucket_mb": bucket_mb,
               "checksum": checksum, "digest": digest,
               "sync_timeout_s": ROW_TIMEOUT_S / 2, "connect_timeout_s": 120.0,
               # throughput, not liveness, is measured here: a busy machine must not abort a version
               "heartbeat_timeout_s": 60.0, **({"delta": delta} if delta != "off" else {})}
        coord = self._coordinator(cfg, f"wsbench-{os.getpid()}-{next(self._ids)}")
        seconds, prestaged, prefetched, stage_s = [], [], [], []
        changed: list[float] = []
        samples = new_samples()
        try:
            ray.get([r.open.remote(coord, cfg) for r in rx], timeout=ROW_TIMEOUT_S)
            ray.get(trainer.open.remote(coord, cfg, receivers), timeout=ROW_TIMEOUT_S)
            label = f"{transport} {bucket_mb:g}MiB x{receivers}"
            with self.progress.bar(self.warmup + self.versions + self.barrier_versions, label) as bar:
                for i in range(self.warmup + self.versions):
                    check()
                    v = next(self._version)
                    applied = [r.apply.remote(v) for r in rx]  # receivers wait before the trainer stages
                    out = ray.get(trainer.step.remote(v), timeout=ROW_TIMEOUT_S)
                    ends = ray.get(applied, timeout=ROW_TIMEOUT_S)
                    if i >= self.warmup:
                        seconds.append(max([e["end"] for e in ends] + [out["end"]]) - out["t0"])
                        stage_s.append(out["stage_s"])
                        changed.append(out.get("changed_fraction"))
                        add_version(samples, out, [e["metrics"] for e in ends], phases=True, barrier=False)
                    tick(bar)
                for i in range(self.barrier_versions):
                    check()
                    v = next(self._version)
                    staged = ray.get(trainer.stage.remote(v), timeout=ROW_TIMEOUT_S)
                    # every other version as if the rollout prefetched while generating; a fixed-cost
                    # row times the plain barrier only
                    ahead = i % 2 == 1 and not self.fixed_cost
                    if ahead and not ray.get([r.prefetch.remote(v) for r in rx], timeout=ROW_TIMEOUT_S)[0]:
                        ahead = False  # nothing to read ahead on this transport: a plain barrier
                    t0 = time.monotonic()  # CLOCK_MONOTONIC is one clock for every process on the node
                    applied = [r.apply.remote(v) for r in rx]
                    out = ray.get(trainer.sync.remote(v), timeout=ROW_TIMEOUT_S)
                    ends = ray.get(applied, timeout=ROW_TIMEOUT_S)
                    took = max([e["end"] for e in ends] + [out["end"]]) - t0
                    if ahead:
                        prefetched.append(took)
                    else:
                        prestaged.append(took)
                        if self.fixed_cost:
                            stage_s.append(staged)
                        # after prefetch() a receiver's calls split between it and apply(): not counted
                        add_version(samples, out, [e["metrics"] for e in ends], phases=self.fixed_cost, barrier=True)
                    tick(bar)
            row["verified"] = self._verify(rx, trainer)
        except Exception as exc:
            row["error"] = describe_error(exc)
        except KeyboardInterrupt:
            # the actors are mid-version: closing their sessions would wait on them (minutes)
            self.interrupted = True
            raise
        finally:
            closed = {} if self.interrupted or asked() else self._close_sessions(rx, trainer)
            coord.shutdown()
        row.update(closed)
        if row["transport"] == "auto" and closed.get("chosen"):
            row["name"] = f"auto->{closed['chosen']}" + ("" if checksum else " (no digest)") + suffix
        row["prestaged_s"] = prestaged
        row["stage_s"] = statistics.median(stage_s) if stage_s else None
        row["barrier_s"] = statistics.median(prestaged) if prestaged else None
        row["prefetched_s"] = prefetched
        row["changed_fraction"] = changed
        row["prefetched_barrier_s"] = statistics.median(prefetched) if prefetched else None
        # where a receiver's time goes, the coordinator calls of a version and the sender's own sync()
        # time (medians over versions and receivers; rounds.merge_rounds pools every round's samples)
        row.update(medians(samples))
        row["samples"] = samples
        return self._finish(row, prestaged if self.fixed_cost else seconds)

    def _close_sessions(self, rx: list, trainer: Any) -> dict[str, Any]:
        out: dict[str, Any] = {}
        try:
            t = ray.get(trainer.close_session.remote(), timeout=ROW_TIMEOUT_S)
            out.update(sender_peak_extra_bytes=t["peak_extra"], shm_bytes=t["shm_bytes"], chosen=t["transport"],
                       delta_state=t.get("delta_state"))
        except Exception as exc:
            out["error_close"] = "trainer: " + describe_error(exc)
        try:
            rs = ray.get([r.close_session.remote() for r in rx], timeout=ROW_TIMEOUT_S)
            out["receivers_peak_extra_bytes"] = [r["peak_extra"] for r in rs]
            out["receiver_peak_extra_bytes"] = max(out["receivers_peak_extra_bytes"])
        except Exception as exc:
            out["error_close"] = "receivers: " + describe_error(exc)
        return out

    # -- Ray object store ------------------------------------------------------------------

    def ray_row(self, kind: str, receivers: int) -> dict[str, Any]:
        """``ray-user``: ray.put(state_dict of torch tensors) / ray.get + load_weights, as a user
        writes it. ``ray-numpy``: numpy views, read zero-copy from the store, then loaded."""
        row = self._row(kind="baseline", name=kind, receivers=receivers)
        rx = self.rollouts[:receivers]
        seconds, put_s, changed = [], [], []
        try:
            ray.get([a.start_peak.remote() for a in [self.trainer, *rx]])
            with self.progress.bar(self.warmup + self.versions, f"{kind} x{receivers}") as bar:
                for i in range(self.warmup + self.versions):
                    put = ray.get(self.trainer.ray_put.remote(kind, next(self._version)), timeout=ROW_TIMEOUT_S)
                    ends = ray.get([r.ray_load.remote(put["ref"]) for r in rx], timeout=ROW_TIMEOUT_S)
                    del put["ref"]  # the object leaves the store once every holder dropped it
                    if i >= self.warmup:
                        changed.append(put.get("changed_fraction"))
                        seconds.append(max(e["end"] for e in ends) - put["t0"])
                        put_s.append(put["put_s"])
                    tick(bar)
            row["verified"] = self._verify(rx)
            row["sender_peak_extra_bytes"] = ray.get(self.trainer.peak_extra.remote())
            row["receivers_peak_extra_bytes"] = ray.get([r.peak_extra.remote() for r in rx])
            row["receiver_peak_extra_bytes"] = max(row["receivers_peak_extra_bytes"])
        except Exception as exc:
            row["error"] = describe_error(exc)
        row["stage_s"] = statistics.median(put_s) if put_s else None  # the trainer is blocked for the put
        row["changed_fraction"] = changed
        return self._finish(row, seconds)

    # -- baselines with actors of their own: rdt_rows (Ray Direct Transport), baseline_rows ----

    def rdt_row(self, kind: str, receivers: int) -> dict[str, Any]:
        from . import rdt_rows

        return rdt_rows.row(self, kind, receivers)

    def collective_row(self, kind: str, receivers: int, backend: str) -> dict[str, Any]:
        from . import baseline_rows

        return baseline_rows.row(self, kind, receivers, backend)


def module_available(name: str) -> bool:
    try:
        importlib.import_module(name)
        return True
    except ImportError:
        return False
