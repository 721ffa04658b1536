"""The job of tests/test_hosts.py, run inside host 0 of a benchmarks/weightsync_bench/hostnet.py cluster as
``python tests/hostjob.py`` (WS_RAY_ADDRESS names the head). Public API only: a coordinator, a
trainer and two rollouts, each rollout's engine a dict of tensors whose ``load_weights`` copies
in place.

Trainer and coordinator on host 0, ``rollout-0`` on host 1, ``rollout-1`` on host 2, placed by
the hosts' Ray resources; transport ``auto``.

The links are the test's: where the job needs one cut, restored, slowed or a host killed, it
prints ``EVENT {"event": ..., ...}`` on stdout and waits for the test's answer, one JSON line
on stdin (what it did, and when: ``time.time()``, one clock for every namespace). Every fault
lands at a fault point: a receiver's engine blocks inside ``load_weights`` at call k of a
version (``hold``), or the trainer's tensor iterator before tensor i (``hold``), until
released; the job acts from there and waits for states the coordinator reports, never for
time to pass. A receiver writes the outcome of each apply() to ``/tmp/wsjob/<name>-v<v>.json``
on its own host (the test reads it there while the job cannot reach that host). What it saw
is the last line: ``RESULT {...}``.

Phases, in the order WS_JOB_PHASES names them (default: all but the slow one), on one job:
  placement        v1, v2 commit on both hosts; placement, transport, bytes over each link in v2
  slow_link        host 2's link at 50 Mbit/s: the version commits, no party is seen dead meanwhile
  partition        both rollouts held at load call 1, host 2's link cut; aborted, named; link
                   restored, rollout-1 released; the next version commits on both
  coordinator_cut  the trainer held before tensor 3 once both rollouts loaded 2 calls, host 0's
                   link cut until the coordinator aborted the version, then restored; the next
                   version commits on both
  lost_host        both rollouts held at load call 1, every process of host 2 killed; the next
                   version commits on host 1 alone
  coordinator_cut_long  (slow) as coordinator_cut, host 0's link cut until both rollouts
                   failed on their own (WS_CUT_LIMIT_S at most)
  hostile          clients without the session token on host 2 (the test starts them): 200 idle
                   connections to the coordinator's control channel, 24 streaming 64 MiB frames;
                   two versions commit meanwhile; the coordinator's memory before and after
WS_CONNECT_TIMEOUT_S sets the parties' connect_timeout_s (60 by default).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

import ray
import torch

from weightsync import Coordinator, SyncConfig, SyncFailed, WeightReceiver, WeightSender

DEADLINE_S = 30.0
CFG = {"transport": "auto", "bucket_mb": 4.0, "sync_timeout_s": DEADLINE_S, "device": "cpu",
       "heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 3.0,
       "connect_timeout_s": float(os.environ.get("WS_CONNECT_TIMEOUT_S", "60"))}
# 8 bf16 tensors of 4 MiB in 4 MiB buckets: a version (32 MiB) is far larger than a bucket plus
# the socket buffers, so a member held at a load call stops the sender
LAYOUT = [(f"layers.{i}.w", (2048, 1024)) for i in range(8)]
BOTH = ("rollout-0", "rollout-1")
PAYLOAD = sum(a * b * 2 for _, (a, b) in LAYOUT)
OUTCOMES = "/tmp/wsjob"  # on each host's own /tmp
HOLD_S = 120.0  # a fault point never released (its process killed) frees its thread after this


def weights(version: int) -> dict[str, torch.Tensor]:
    """Version v's weights: the same bits wherever they are made."""
    g = torch.Generator().manual_seed(version)
    return {name: torch.randn(shape, generator=g).to(torch.bfloat16) for name, shape in LAYOUT}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.int16), b.view(torch.int16))


class Gate:
    """One fault point: the first pass at ``at`` signals ``reached`` and waits for ``release``."""

    def __init__(self, at: tuple = ()):
        self.at, self.reached, self.release = at, threading.Event(), threading.Event()

    def pass_(self, point: tuple) -> None:
        if point == self.at and not self.reached.is_set():
            self.reached.set()
            self.release.wait(HOLD_S)


class Engine:
    """A model: a dict of tensors; ``load_weights`` copies in place, counting its calls per
    version, and blocks at the fault point (version, call) until released."""

    def __init__(self) -> None:
        self.params = {name: torch.zeros(shape, dtype=torch.bfloat16) for name, shape in LAYOUT}
        self.gate, self.loading, self.calls = Gate(), None, 0

    def load_weights(self, pairs) -> None:
        call, self.calls = self.calls, self.calls + 1
        self.gate.pass_((self.loading, call))
        for name, tensor in pairs:
            self.params[name].copy_(tensor)


class Rollout:
    def __init__(self, coord: Coordinator, name: str, rank: int):
        self.name, self.engine = name, Engine()
        self.receiver = WeightReceiver(coord, self.engine.load_weights, name=name, rank=rank,
                                       expected=self.engine.params, config=SyncConfig.load(CFG))

    def where(self) -> dict[str, Any]:
        return {"node_id": ray.get_runtime_context().get_node_id(), "host": os.environ.get("WS_HOST"),
                "address": os.environ.get("WS_HOST_ADDRESS")}

    def hold(self, version: int, call: int) -> None:
        self.engine.gate = Gate((version, call))

    def reached(self, timeout: float) -> bool:
        return self.engine.gate.reached.wait(timeout)

    def release(self) -> None:
        self.engine.gate.release.set()

    def loads(self) -> int:
        return self.engine.calls

    def apply(self, version: int) -> dict[str, Any]:
        self.engine.loading, self.engine.calls = version, 0
        t0 = time.time()
        try:
            out = {"version": self.receiver.apply(version)}
        except Exception as exc:  # the outcome is what the test asserts
            out = {"error": f"{type(exc).__name__}: {exc}"[-1500:]}
        out.update(started=t0, at=time.time())
        os.makedirs(OUTCOMES, exist_ok=True)
        with open(f"{OUTCOMES}/{self.name}-v{version}.json", "w") as f:
            json.dump(out, f)
        return out

    def serves(self) -> dict[str, Any]:
        """The version served, and whether the engine holds exactly its weights."""
        v = self.receiver.version
        if v is None:
            return {"version": None}
        want = weights(v)
        return {"version": v, "bit_exact": all(same_bits(self.engine.params[n], want[n]) for n in want)}

    def close(self) -> None:
        self.receiver.close()


class Trainer:
    def __init__(self, coord: Coordinator, receivers: int):
        self.sender = WeightSender(coord, rank=0, config=SyncConfig.load(CFG), expected_receivers=receivers)
        self.gate = Gate()

    def hold(self, version: int, tensor: int) -> None:
        self.gate = Gate((version, tensor))

    def reached(self, timeout: float) -> bool:
        return self.gate.reached.wait(timeout)

    def release(self) -> None:
        self.gate.release.set()

    def step(self, version: int) -> dict[str, Any]:
        """Stage and sync ``version``; the tensor iterator passes the fault point (a broadcast
        packs at the barrier: the hold lands in sync())."""
        gate = self.gate
        tensors = ((n, t) for i, (n, t) in enumerate(weights(version).items())
                   if gate.pass_((version, i)) is None)
        t0 = time.time()
        try:
            self.sender.stage(version, tensors).wait()
            result = self.sender.sync(version)
            return {"committed": True, "seconds": time.time() - t0, "barrier_s": result.barrier_s}
        except SyncFailed as err:
            return {"failed": err.failed, "committed": err.committed, "at": time.time()}

    def close(self) -> None:
        self.sender.close()


def ask(event: str, **data: Any) -> dict[str, Any]:
    """The test acts on the links (cut, restore, rate, kill) and answers."""
    print("EVENT " + json.dumps({"event": event, **data}), flush=True)
    line = sys.stdin.readline()
    if not line:
        raise RuntimeError(f"the test did not answer {event!r}")
    return json.loads(line)


def wait_until(what: str, cond, timeout: float = DEADLINE_S + 30, interval: float = 0.05) -> Any:
    end = time.monotonic() + timeout
    while True:
        try:
            got = cond()
        except Exception:
            got = None
        if got:
            return got
        if time.monotonic() > end:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting until {what}")
        time.sleep(interval)


def again(call, *args: Any, timeout: float = 60.0) -> Any:
    """An idempotent actor call, retried while Ray calls its actor temporarily unavailable: the
    first call after a link comes back can meet the connection Ray's cut left reset."""
    end = time.monotonic() + timeout
    while True:
        try:
            return ray.get(call.remote(*args), timeout=max(1.0, end - time.monotonic()))
        except ray.exceptions.ActorUnavailableError:
            if time.monotonic() > end:
                raise
            time.sleep(0.5)


def on(host: int) -> dict[str, Any]:
    """Ray options of a party on ``host``, threaded: reached() / release() run beside a held
    apply() or step()."""
    return {"num_cpus": 0, "resources": {f"host{host}": 1}, "max_concurrency": 4}


class Job:
    def __init__(self) -> None:
        self.coord = Coordinator.create(CFG, name=f"ws-hosts-{os.getpid()}",
                                        actor_options={"resources": {"host0": 0.01}})
        self.rollouts = {name: ray.remote(Rollout).options(**on(host)).remote(self.coord, name, rank)
                         for rank, (name, host) in enumerate((("rollout-0", 1), ("rollout-1", 2)))}
        self.trainer = ray.remote(Trainer).options(**on(0)).remote(self.coord, 2)
        ray.get([r.where.remote() for r in self.rollouts.values()], timeout=120)
        self.v = 0

    def next(self) -> int:
        self.v += 1
        return self.v

    def metrics(self, v: int) -> dict[str, Any]:
        m = self.coord.metrics(v)
        return {"state": m.state, "reason": m.reason, "failed": m.failed, "committed": m.committed}

    def serves(self, names) -> dict[str, Any]:
        return {n: again(self.rollouts[n].serves) for n in names}

    def step(self, v: int, names=("rollout-0", "rollout-1")) -> dict[str, Any]:
        applied = {n: self.rollouts[n].apply.remote(v) for n in names}
        sync = ray.get(self.trainer.step.remote(v), timeout=DEADLINE_S + 60)
        got = {n: ray.get(r, timeout=DEADLINE_S + 30) for n, r in applied.items()}
        return {"sync": sync, "applied": {n: o.get("version", o.get("error")) for n, o in got.items()},
                **self.metrics(v), "serves": self.serves(names)}

    def held(self, v: int, call: int, names) -> tuple[dict, Any]:
        """Both rollouts held at load call ``call`` of ``v``, the trainer syncing it."""
        ray.get([self.rollouts[n].hold.remote(v, call) for n in names])
        applied = {n: self.rollouts[n].apply.remote(v) for n in names}
        sync = self.trainer.step.remote(v)
        assert all(ray.get([self.rollouts[n].reached.remote(DEADLINE_S) for n in names], timeout=DEADLINE_S + 10))
        return applied, sync

    def party_alive(self) -> dict[str, bool]:
        return {p.name: p.alive for p in self.coord.status().parties}


def placement(job: Job, out: dict[str, Any]) -> None:
    """Where each party runs; v1 and v2 commit; what crossed each link in v2."""
    status = job.coord.status()
    out["parties"] = {p.name: {"host": p.host, "node_id": p.node_id} for p in status.parties}
    out["where"] = {n: ray.get(r.where.remote()) for n, r in job.rollouts.items()}
    out["nodes"] = {next(k for k in n["Resources"] if k.startswith("host")): n["NodeID"]
                    for n in ray.nodes() if n["Alive"]}
    out["payload"] = PAYLOAD
    out["v1"] = job.step(job.next())
    status = job.coord.status()
    out["transport"], out["reason"] = status.transport, status.transport_reason
    before = ask("links")["links"]
    t0 = time.time()
    out["v2"] = job.step(job.next())
    out["v2"]["seconds"] = time.time() - t0
    out["v2"]["links"] = [[a - b for a, b in zip(after, first)]
                          for after, first in zip(ask("links")["links"], before)]


def slow_link(job: Job, out: dict[str, Any]) -> None:
    """Host 2's link at 50 Mbit/s under a version that takes longer than heartbeat_timeout_s
    there (and fits sync_timeout_s): every party the coordinator reports dead meanwhile."""
    v = job.next()
    ask("rate", host=2, gbit=0.05)
    seen_dead: list = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            try:
                seen_dead.extend(n for n, alive in job.party_alive().items() if not alive)
                seen_dead.extend(f"failed:{n}" for n in job.coord.metrics(v).failed)
            except Exception:
                pass
            stop.wait(0.1)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    t0 = time.time()
    try:
        out["v"] = job.step(v)
    finally:
        stop.set()
        watcher.join()
    out["v"].update(seconds=time.time() - t0, seen_dead=sorted(set(seen_dead)), version=v)
    ask("rate", host=2, gbit=None)


def partition(job: Job, out: dict[str, Any]) -> None:
    """Both rollouts held inside load_weights at call 1, host 2's link cut; once the version
    is aborted, host 1's rollout released; host 2's link restored, its rollout released."""
    v = job.next()
    applied, sync = job.held(v, 1, BOTH)
    cut = ask("cut", host=2)
    wait_until(f"v{v} is aborted", lambda: job.metrics(v)["state"] == "ABORTED")
    got = {"version": v, "aborted_after_s": time.time() - cut["at"], "cut_at": cut["at"], **job.metrics(v)}
    ray.get(job.rollouts["rollout-0"].release.remote())
    got["sync"] = ray.get(sync, timeout=DEADLINE_S + 30)
    got["rollout-0"] = ray.get(applied["rollout-0"], timeout=DEADLINE_S + 30)
    got["serves"] = job.serves(["rollout-0"])
    ask("restore", host=2)
    again(job.rollouts["rollout-1"].release)
    got["rollout-1"] = ray.get(applied["rollout-1"], timeout=DEADLINE_S + 30)
    got["serves"].update(job.serves(["rollout-1"]))
    wait_until("rollout-1 is seen alive again", lambda: job.party_alive().get("rollout-1"))
    out["v"] = got
    out["next"] = job.step(job.next())


def _held_trainer(job: Job, v: int) -> tuple[dict, Any]:
    """The trainer held before tensor 3 of ``v`` once both rollouts loaded 2 calls of it."""
    ray.get(job.trainer.hold.remote(v, 3))
    applied = {n: job.rollouts[n].apply.remote(v) for n in BOTH}
    step = job.trainer.step.remote(v)
    assert ray.get(job.trainer.reached.remote(DEADLINE_S), timeout=DEADLINE_S + 10)
    wait_until(f"both rollouts loaded 2 calls of v{v}",
               lambda: min(ray.get([job.rollouts[n].loads.remote() for n in BOTH])) >= 2)
    return applied, step


def _outcomes(v: int) -> dict[str, str]:
    """Where each rollout writes the outcome of its apply(v), by host."""
    return {"1": f"{OUTCOMES}/rollout-0-v{v}.json", "2": f"{OUTCOMES}/rollout-1-v{v}.json"}


def _after_cut(job: Job, v: int, applied: dict, step: Any, got: dict[str, Any]) -> None:
    """Host 0's link is back: the trainer released; what each party ended with."""
    ray.get(job.trainer.release.remote())
    got["sync"] = ray.get(step, timeout=DEADLINE_S + 30)
    # each rollout's outcome as it wrote it on its host (a Ray call in flight across the cut
    # may lose its result: Ray resets the connection), and the call's own result
    got["outcomes"] = ask("await-files", files=_outcomes(v), timeout=DEADLINE_S + 60)["files"]
    for n in BOTH:
        try:
            got[n] = ray.get(applied[n], timeout=DEADLINE_S + 30)
        except Exception as exc:
            got[n] = {"ray_error": f"{type(exc).__name__}: {exc}"[-500:]}
    wait_until("both rollouts are seen alive again", lambda: all(job.party_alive().get(n) for n in BOTH))
    got["serves"] = job.serves(BOTH)


def coordinator_cut(job: Job, out: dict[str, Any]) -> None:
    """The coordinator's host cut off, as long as it takes the coordinator to abort the
    version: the trainer held before tensor 3 once both rollouts loaded 2 calls; host 0's
    link cut; once the coordinator (on host 0) has aborted the version, the test reads the
    rollouts' outcome files on their hosts and restores the link."""
    v = job.next()
    applied, step = _held_trainer(job, v)
    cut = ask("cut", host=0)
    wait_until(f"v{v} is aborted", lambda: job.metrics(v)["state"] == "ABORTED")
    got = {"version": v, "aborted_after_s": time.time() - cut["at"], **job.metrics(v)}
    restored = ask("restore", host=0, files=_outcomes(v))
    got["cut_s"], got["outcomes_while_cut"] = restored["at"] - cut["at"], restored["files"]
    _after_cut(job, v, applied, step, got)
    out["v"] = got
    out["next"] = job.step(job.next())


def coordinator_cut_long(job: Job, out: dict[str, Any]) -> None:
    """As coordinator_cut, but host 0's link stays cut until both rollouts have failed on
    their own (the test waits for their outcome files, up to WS_CUT_LIMIT_S)."""
    v = job.next()
    applied, step = _held_trainer(job, v)
    cut = ask("cut-until", host=0, files=_outcomes(v), timeout=float(os.environ.get("WS_CUT_LIMIT_S", "200")))
    got = {"version": v, "cut": cut, "outcomes_while_cut": cut["files"], **job.metrics(v)}
    _after_cut(job, v, applied, step, got)
    out["v"] = got
    out["next"] = job.step(job.next())


def lost_host(job: Job, out: dict[str, Any]) -> None:
    """Both rollouts held at load call 1, every process of host 2 killed."""
    v = job.next()
    applied, sync = job.held(v, 1, BOTH)
    killed = ask("kill", host=2)
    wait_until(f"v{v} is aborted", lambda: job.metrics(v)["state"] == "ABORTED")
    got = {"version": v, "aborted_after_s": time.time() - killed["at"], **job.metrics(v)}
    ray.get(job.rollouts["rollout-0"].release.remote())
    got["sync"] = ray.get(sync, timeout=DEADLINE_S + 30)
    got["rollout-0"] = ray.get(applied["rollout-0"], timeout=DEADLINE_S + 30)
    got["serves"] = job.serves(["rollout-0"])
    out["v"] = got
    out["next"] = job.step(job.next(), ("rollout-0",))


def _coordinator_rss(port: int) -> int:
    """Resident bytes of the coordinator process: the one of this host listening on ``port``."""
    import psutil

    for p in psutil.process_iter():
        try:
            if any(c.laddr.port == port and c.status == psutil.CONN_LISTEN for c in p.net_connections("tcp")):
                return p.memory_info().rss
        except psutil.Error:
            continue
    raise RuntimeError(f"no process of host 0 listens on port {port}")


def hostile(job: Job, out: dict[str, Any]) -> None:
    """Clients without the token on another host, while versions commit."""
    from weightsync.records import Channel

    address = job.coord.call(Channel())
    before = _coordinator_rss(address.port)
    ask("hostile", host=2, address=address.host, port=address.port)
    versions = [job.step(job.next()) for _ in range(2)]
    after = _coordinator_rss(address.port)
    ask("hostile-end", host=2)
    out.update(grown=after - before, versions=versions)


PHASES = {"placement": placement, "slow_link": slow_link, "partition": partition,
          "coordinator_cut": coordinator_cut, "lost_host": lost_host, "hostile": hostile}
SLOW_PHASES = {"coordinator_cut_long": coordinator_cut_long}  # named in WS_JOB_PHASES only


def run(out: dict[str, Any], phases: list[str]) -> None:
    job = Job()
    for name in phases:
        out[name] = {}
        t0 = time.time()
        {**PHASES, **SLOW_PHASES}[name](job, out[name])
        out[name]["phase_s"] = time.time() - t0
    for actor in (job.trainer, job.rollouts["rollout-0"]):
        ray.get(actor.close.remote(), timeout=10)
    job.coord.shutdown()


def main() -> None:
    out: dict[str, Any] = {}
    t0 = time.time()
    try:
        ray.init(address=os.environ["WS_RAY_ADDRESS"], log_to_driver=False, logging_level="ERROR")
        run(out, os.environ.get("WS_JOB_PHASES", " ".join(PHASES)).split())
    except BaseException as exc:
        import traceback

        out["error"] = f"{type(exc).__name__}: {exc}"[-3000:]
        traceback.print_exc()
    finally:
        out["total_s"] = time.time() - t0
        print("RESULT " + json.dumps(out, default=str), flush=True)
        os._exit(0)  # the cluster goes with its hosts; Ray's shutdown would wait on a lost node


if __name__ == "__main__":
    main()
