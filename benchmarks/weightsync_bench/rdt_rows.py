"""Internal. The Ray Direct Transport baselines (``ray-rdt-*``): what a Ray user writes today to move
weights from a trainer actor to a rollout actor without an object-store copy.

The trainer's method returns the version's tensors with ``tensor_transport=...``; the driver
passes the returned ref to each rollout's method as an argument; Ray moves the tensors out of
band (GLOO / NCCL send-recv, or a CUDA IPC handle) and the rollout copies them into its
model with ``load_weights``, the same contract as the weightsync rows.

What it takes to run, read from Ray 2.60's own source and tests (ray/experimental/rdt/,
python/ray/tests/rdt/test_rdt_gloo.py):

- **Both** actors need tensor transport enabled (``@ray.remote(enable_tensor_transport=True)``
  or a ``@ray.method(tensor_transport=...)`` on the class). Ray then adds the ``_ray_system``
  concurrency group (ray/actor.py, around "Ray GPU objects requires a background thread",
  ray-project/ray#54639), on which the driver schedules ``__ray_send__`` / ``__ray_recv__``.
  A rollout class without it runs the receive behind its own task, which is waiting for the
  tensors: a deadlock that Ray's monitor ends after RAY_rdt_fetch_fail_timeout_milliseconds
  (60 s) with "RDT transfer failed after 60.0s", killing both actors. That is the failure
  issue 36 met, with any layout (tiny too).
- GLOO and NCCL are two-sided: the ref must be passed as a task argument; ``ray.get`` of it
  inside the receiving actor raises (rdt_manager.py: "ray.get is not allowed on RDT objects
  using the two-sided transport"). Both actors must be in one collective group of that
  backend (``ray.experimental.collective.create_collective_group``; "torch_gloo" is "gloo").
  Each tensor is one send/recv: no tensor count limit, no packing.
- GLOO carries CPU tensors only, NCCL CUDA tensors only (util.py registers them so), and
  Ray's NCCL group is built on CuPy (ray/util/collective/collective_group/nccl_collective_group.py).
- CUDA_IPC is one-sided and needs no group, but the receiver must hold the same GPU from Ray
  as the sender (fractional ``num_gpus`` on one device) on the same node (cuda_ipc_transport.py);
  the rollout gets views of the trainer's memory and its load is the one device copy.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import time
from typing import Any

import ray

from .actors import BenchRollout, BenchTrainer

# baseline name -> (Ray's tensor_transport, the device it carries, a collective group backend or None)
TRANSPORTS = {
    "ray-rdt-gloo": ("gloo", "cpu", "gloo"),
    "ray-rdt-cuda-ipc": ("cuda_ipc", "cuda", None),
    "ray-rdt-nccl": ("nccl", "cuda", "nccl"),
}
# ``--baselines ray-rdt``: the rows that can run on the device
BY_DEVICE = {"cpu": ["ray-rdt-gloo"], "cuda": ["ray-rdt-cuda-ipc", "ray-rdt-nccl"]}
TIMEOUT_ENV = "RAY_rdt_fetch_fail_timeout_milliseconds"


def expand(baselines: list[str], device: str) -> list[str]:
    """``ray-rdt`` -> the RDT rows for ``device`` (none on npu: Ray has no HCCL transport)."""
    out: list[str] = []
    for b in baselines:
        out += BY_DEVICE.get(device, ["ray-rdt-gloo"]) if b == "ray-rdt" else [b]
    return list(dict.fromkeys(out))


def unavailable(name: str, device: str) -> str | None:
    """Why the RDT row ``name`` cannot run here, naming the Ray source that says so; or None."""
    transport, needs, backend = TRANSPORTS[name]
    if importlib.util.find_spec("ray.experimental.rdt") is None:
        return "this Ray has no ray.experimental.rdt (Ray Direct Transport needs Ray >= 2.50)"
    if device != needs:
        also = ("; Ray has no HCCL tensor transport (DEFAULT_TRANSPORTS in ray/experimental/rdt/util.py: NIXL, "
                "GLOO, NCCL, CUDA_IPC)" if device == "npu" else "")
        return (f"Ray's {transport.upper()} tensor transport carries {needs} tensors only "
                f"(ray/experimental/rdt/util.py registers it for [{needs!r}]); run with --device {needs}{also}")
    if backend == "nccl" and importlib.util.find_spec("cupy") is None:
        return ("Ray's NCCL collective group is built on CuPy, which is not installed "
                "(ray/util/collective/collective_group/nccl_collective_group.py); pip install cupy-cuda12x")
    return None


def _gpu_ids(self) -> list:
    return [str(g) for g in ray.get_gpu_ids()]


class RdtTrainer(BenchTrainer):
    """The bench trainer (same layout, seed and update model) whose version leaves by RDT."""

    gpu_ids = _gpu_ids

    def tensors_out(self) -> list:
        """This version's tensors, as the trainer holds them; the caller picks the transport
        with ``.options(tensor_transport=...)``. Ray keeps them in this actor until sent."""
        return list(self.tensors.values())


class RdtRollout(BenchRollout):
    """The bench rollout whose engine is fed from an RDT ref passed as the argument."""

    gpu_ids = _gpu_ids

    def load_rdt(self, tensors: list) -> dict[str, Any]:
        self.engine.load_weights(zip(self.engine.params, tensors, strict=True))
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize()  # the copies are queued on the stream: the version is in when they ran
        return {"end": time.monotonic()}


class RdtPair:
    """A trainer and rollouts with tensor transport enabled, kept for the run (their models are
    the run's bytes; making them again costs more than a row). Constructing one only starts the
    actors, so that they make their models while the bench's own actors make theirs (on a
    2-core VM that halves the wait); ``ready()`` waits for them and builds the group. The
    bench's own actors stay as they are: enabling tensor transport moves every task of an actor
    off its main thread, which the transport rows must not see."""

    def __init__(self, name: str, manifest_wire: list, device: str, receivers: int, update: dict[str, Any],
                 base_opts: dict[str, Any], colocated: dict[str, Any], spread: dict[str, Any]):
        transport, _, backend = TRANSPORTS[name]
        self.transport, self.receivers = transport, receivers
        env = {TIMEOUT_ENV: os.environ[TIMEOUT_ENV]} if TIMEOUT_ENV in os.environ else {}
        # NCCL: one device per party; CUDA_IPC: the same device for all (the receiver must hold
        # the sender's GPU from Ray); GLOO on CPU: no device
        opts = {**base_opts, **(spread if backend == "nccl" else colocated)}
        if env:
            opts["runtime_env"] = {"env_vars": env}
        remote = {"enable_tensor_transport": True}
        self.trainer = ray.remote(**remote)(RdtTrainer).options(**opts).remote(manifest_wire, device, None, **update)
        self.rollouts = [ray.remote(**remote)(RdtRollout).options(**opts).remote(
            manifest_wire, f"bench-rdt-rollout-{i}", i + 1, device) for i in range(receivers)]
        self.backend = backend
        self.pids: list[int] = []
        self.group = None
        self._ready = False

    def ready(self, timeout: float = 600) -> None:
        """Wait for the actors (and check where Ray placed them), then build the group; once."""
        if self._ready:
            return
        self.pids = ray.get([a.pid.remote() for a in self.actors], timeout=timeout)
        if self.transport == "cuda_ipc":
            # Ray may place fractional GPU requests on different devices of a multi-GPU node
            ids = ray.get([a.gpu_ids.remote() for a in self.actors], timeout=600)
            if any(i != ids[0] for i in ids):
                self.close()
                raise RuntimeError(f"CUDA_IPC needs the rollouts on the trainer's GPU; Ray placed them on {ids} "
                                   "(ray/experimental/rdt/cuda_ipc_transport.py: same GPU, same node)")
        if self.backend:
            from ray.experimental.collective import create_collective_group

            self.group = create_collective_group(self.actors, backend=self.backend)
        self._ready = True

    @property
    def actors(self) -> list[Any]:
        return [self.trainer, *self.rollouts]

    def version(self, version: int, receivers: int, timeout: float) -> dict[str, Any]:
        """One version: made (untimed, as in every row), then from the trainer's call to the
        last rollout's load."""
        changed = ray.get(self.trainer.bump.remote(version), timeout=timeout)
        t0 = time.monotonic()
        ref = self.trainer.tensors_out.options(tensor_transport=self.transport).remote()
        ends = ray.get([r.load_rdt.remote(ref) for r in self.rollouts[:receivers]], timeout=timeout)
        del ref  # Ray frees the trainer's hold on the tensors once no one holds the ref
        return {"seconds": max(e["end"] for e in ends) - t0, "changed_fraction": changed}

    def close(self) -> None:
        import psutil

        procs = []
        for pid in self.pids:
            with contextlib.suppress(psutil.Error):
                procs.append(psutil.Process(pid))
        if self.group is not None:
            with contextlib.suppress(Exception):
                from ray.experimental.collective import destroy_collective_group

                destroy_collective_group(self.group)
        for a in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(a)
        psutil.wait_procs(procs, timeout=60)


def pair_for(bench: Any, name: str, receivers: int) -> RdtPair:
    """The actors of RDT row ``name`` for the runner's Bench: its layout, device and update
    model, ``receivers`` rollouts; on the bench's device share when colocated (CUDA_IPC)."""
    from weightsync.device import ray_options

    opts = {k: v for k, v in bench._base.items() if k != "runtime_env"}
    return RdtPair(name, bench.manifest.to_wire(), bench.device, receivers, bench._update, opts,
                   ray_options(bench.device, bench._share), ray_options(bench.device, 1))


def row(bench: Any, kind: str, receivers: int) -> dict[str, Any]:
    """``ray-rdt-*``: the trainer's method returns the tensors over Ray Direct Transport,
    each rollout takes the ref as an argument and loads them (the module docstring says what
    Ray needs). ``bench``: the runner's Bench, whose version numbers, settings and bit check it uses."""
    from .interrupt import check, tick
    from .rowkit import ROW_TIMEOUT_S, describe_error, devices_short

    transport, _, backend = TRANSPORTS[kind]
    row = bench._row(kind="baseline", name=kind, receivers=receivers, backend=backend, transport=transport)
    why = unavailable(kind, bench.device)
    if why is None and kind == "ray-rdt-nccl" and kind not in bench._rdt:
        why = devices_short(bench.device, "nccl", len(bench.rollouts) + 1)
    if why:
        row.update(kind="unavailable", error=why)
        return row
    seconds, changed = [], []
    try:
        pair = bench._rdt.get(kind)
        if pair is None:  # made before the first timed version (and kept with keep_baselines)
            pair = bench._rdt[kind] = pair_for(bench, kind, len(bench.rollouts))
        if not pair.pids:
            pair.ready(ROW_TIMEOUT_S)
            bench.pids += pair.pids
        rx = pair.rollouts[:receivers]
        ray.get([a.start_peak.remote() for a in [pair.trainer, *rx]], timeout=ROW_TIMEOUT_S)
        with bench.progress.bar(bench.warmup + bench.versions, f"{kind} x{receivers}") as bar:
            for i in range(bench.warmup + bench.versions):
                check()
                out = pair.version(next(bench._version), receivers, ROW_TIMEOUT_S)
                if i >= bench.warmup:
                    seconds.append(out["seconds"])
                    changed.append(out["changed_fraction"])
                tick(bar)
        row["verified"] = bench._verify(rx, pair.trainer)
        row["sender_peak_extra_bytes"] = ray.get(pair.trainer.peak_extra.remote(), timeout=ROW_TIMEOUT_S)
        row["receivers_peak_extra_bytes"] = ray.get([r.peak_extra.remote() for r in rx], timeout=ROW_TIMEOUT_S)
        row["receiver_peak_extra_bytes"] = max(row["receivers_peak_extra_bytes"])
    except Exception as exc:
        row["error"] = describe_error(exc)
        # Ray kills both actors when a transfer fails: the next round makes a new pair
        dead = bench._rdt.pop(kind, None)
        if dead is not None:
            dead.close()
    if "rdt" not in bench.keep_baselines and kind in bench._rdt:
        bench._rdt.pop(kind).close()
    row["changed_fraction"] = changed
    return bench._finish(row, seconds)


# -- between hosts, every trainer rank sending its own rows (bench --hosts --trainer-ranks) --------

def rows_sent(manifest: Any, rank: int, ranks: int) -> list[tuple[str, int, int]]:
    """(name, first row, end row) of each tensor part trainer rank ``rank`` of ``ranks`` sends, in
    the manifest's order: its rows as ``Shard(0)`` cuts them (torch.chunk), none where it has no
    rows; a 0-dim tensor whole from rank 0 only (every rank holds it)."""
    from weightsync.manifest import chunk_bounds

    out = []
    for spec in manifest:
        if not spec.shape:
            if rank == 0:
                out.append((spec.name, 0, 0))
            continue
        bounds = chunk_bounds(spec.shape[0], ranks)
        if bounds[rank + 1] > bounds[rank]:
            out.append((spec.name, bounds[rank], bounds[rank + 1]))
    return out


class RdtRank:
    """Trainer rank ``rank`` of ``ranks`` for ``ray-rdt-gloo`` between hosts: its rows of the
    layout (materialize, seed 0, cut as ``rows_sent`` says), stepped by the bench's update as
    ranks.TrainerRank steps its rows. No process group of its own: Ray's collective group is
    this process's default one."""

    def __init__(self, manifest_wire: list, rank: int, ranks: int):
        from weightsync.manifest import Manifest

        from .layouts import materialize
        from .updates import Versions

        manifest = Manifest.from_wire(manifest_wire)
        full = materialize(manifest, seed=0)
        # the clones let the full tensors go (a row range is a view of one)
        self.versions = Versions({name: full[name][lo:hi].clone() if full[name].dim() else full[name]
                                  for name, lo, hi in rows_sent(manifest, rank, ranks)})
        self.updates = 0

    def pid(self) -> int:
        return os.getpid()

    def advance(self, update: int) -> None:
        while self.updates < update:
            self.updates += 1
            self.versions.apply(self.updates)

    def rows_out(self) -> list:
        """This rank's rows as it holds them; the caller picks ``tensor_transport``."""
        return list(self.versions.tensors.values())


class RdtRowsRollout(RdtRollout):
    """An RDT rollout that takes every rank's rows (one RDT ref per rank, passed as arguments in
    rank order), joins each tensor's rows and loads the whole tensors, as a user would."""

    def load_rdt_rows(self, *per_rank: list) -> dict[str, Any]:
        import torch

        parts: dict[str, list] = {spec.name: [] for spec in self.manifest}
        for rank, tensors in enumerate(per_rank):
            for (name, _, _), t in zip(rows_sent(self.manifest, rank, len(per_rank)), tensors, strict=True):
                parts[name].append(t)
        return self.load_rdt([p[0] if len(p) == 1 else torch.cat(p) for p in parts.values()])


class RdtRanks:
    """The ``ray-rdt-gloo`` parties between hosts: an RdtRank per trainer rank on its rank's host
    and an RdtRowsRollout per receiver on its host, tensor transport enabled, all in one Ray
    collective group (gloo); apart from the bench's own parties (see RdtPair). ``on(host)``:
    the Ray options that place an actor on a host."""

    def __init__(self, manifest_wire: list, rank_hosts: list[int], receiver_hosts: list[int], on: Any):
        remote = ray.remote(enable_tensor_transport=True)
        ranks = len(rank_hosts)
        self.ranks = [remote(RdtRank).options(**on(h)).remote(manifest_wire, r, ranks)
                      for r, h in enumerate(rank_hosts)]
        self.rollouts = [remote(RdtRowsRollout).options(**on(h)).remote(manifest_wire, f"rdt-rows-{i}", i, "cpu")
                         for i, h in enumerate(receiver_hosts)]
        self.group = None

    def ready(self, timeout: float) -> None:
        from ray.experimental.collective import create_collective_group

        if self.group is None:
            ray.get([a.pid.remote() for a in (*self.ranks, *self.rollouts)], timeout=timeout)
            self.group = create_collective_group([*self.ranks, *self.rollouts], backend="gloo")

    def version(self, update: int, timeout: float) -> dict[str, Any]:
        """The ranks brought to ``update`` (untimed), then from the driver's call until the last
        receiver loaded: every rank's rows out by RDT gloo, each receiver taking every rank's ref."""
        ray.get([a.advance.remote(update) for a in self.ranks], timeout=timeout)
        t0 = time.monotonic()
        refs = [a.rows_out.options(tensor_transport="gloo").remote() for a in self.ranks]
        ends = ray.get([r.load_rdt_rows.remote(*refs) for r in self.rollouts], timeout=timeout)
        del refs
        return {"seconds": max(e["end"] for e in ends) - t0}

    def close(self) -> None:
        if self.group is not None:
            with contextlib.suppress(Exception):
                from ray.experimental.collective import destroy_collective_group

                destroy_collective_group(self.group)
        for a in (*self.ranks, *self.rollouts):
            with contextlib.suppress(Exception):
                ray.kill(a)
