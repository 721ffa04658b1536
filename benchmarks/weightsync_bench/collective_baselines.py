"""Internal. Collective baselines for the broadcast transport, measured with real Ray actors over the
same group construction the transport uses (:class:`weightsync.transports.broadcast.groups.Group`).

- :func:`raw_broadcast`: the version's bytes pre-packed in one flat buffer, sent by a single
  broadcast. The wire limit: no packing, no checksums, no loading, no pipelining to lose.
- :func:`raw_broadcast_load`: the same flat broadcast, then each receiver loads the tensors
  (views into the flat buffer) into its model: the fair wire baseline of the broadcast
  transport, which also ends with the weights in the model; only packing and digests are left out.
- :func:`per_tensor_broadcast`: one broadcast per tensor, each loaded as it arrives: what
  verl's one-step-off-policy recipe does today.
- :func:`bucketed_broadcast`: a whole weightsync version over the broadcast transport
  (pack, send, verify, load, commit), as the trainer sees it: ``stage_s + barrier_s``.

Each returns seconds per repetition. Ray must be initialised by the caller; the actors take
no CPU resource (they measure the machine, not Ray's scheduler) and are killed afterwards.

    python -m weightsync_bench.collective_baselines --layout moe-small --receivers 1 3
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import time
from typing import Any

import ray
import torch

from weightsync.manifest import Manifest
from weightsync.transports.broadcast.communicators import choose_backend, comm_device
from weightsync.transports.broadcast.groups import Group
from weightsync.transports.broadcast.store import connect_store, host_store, store_host

from .engine import ToyEngine
from .layouts import layout, materialize

# a peer that never joins (or a collective that never returns) ends the baseline, not the run
TIMEOUT_S = 300.0


class Peer:
    """One rank of a baseline group: rank 0 sends, the others receive into a ToyEngine."""

    def __init__(self, rank: int, size: int, manifest_wire: list, backend: str = "gloo", device: str = "cpu"):
        from weightsync.device import resolve

        self.rank, self.size = rank, size
        self.manifest = Manifest.from_wire(manifest_wire)
        self.backend = backend
        self.device = comm_device(backend, resolve(device), f"bench rank {rank}")
        self.store: Any = None
        self.group: Group | None = None
        self.tensors: dict[str, torch.Tensor] = {}
        self.flat: torch.Tensor | None = None
        self.engine: ToyEngine | None = None
        self.want: str | None = None  # the sender's digest of the version (model_digest)

    def host(self, port: int = 0, host: str = "auto") -> tuple[str, int]:
        address = store_host(host)
        self.store = host_store(address, port, 60.0)
        return address, self.store.port

    def join(self, host: str, port: int, prefix: str, timeout: float = 60.0) -> None:
        if self.store is None:
            self.store = connect_store(host, port, timeout)
        names = [f"bench-{r}" for r in range(self.size)]
        self.group = Group.build(self.backend, self.store, prefix, self.rank, self.size, self.device, timeout, names)

    def prepare(self, method: str, seed: int = 1) -> None:
        """What ``method`` needs, made before any timing: for ``raw`` the flat buffer (the
        sender's filled with the version), for ``per_tensor`` the tensors or the model."""
        tensors = materialize(self.manifest, seed=seed) if self.rank == 0 else {}
        if self.rank == 0:
            # what every receiver's model must hold afterwards, hashed now (outside the timing):
            # hashing is cheaper than making the random bits a second time to compare against
            from .bits import digest

            self.want = digest(tensors)
        if method in ("raw", "raw_load"):
            self.flat = torch.empty(self.manifest.total_bytes, dtype=torch.uint8, device=self.device)
            if self.rank == 0:
                offset = 0
                for t in tensors.values():
                    n = t.numel() * t.element_size()
                    self.flat[offset: offset + n].copy_(t.reshape(-1).view(torch.uint8))
                    offset += n
            else:
                self.flat.fill_(1)  # fault the pages in now, not inside the timed broadcast
                if method == "raw_load":
                    self.engine = ToyEngine(self.manifest, device=str(self.device))
        elif self.rank == 0:
            self.tensors = {k: t.to(self.device) for k, t in tensors.items()}
        else:
            self.engine = ToyEngine(self.manifest, device=str(self.device))

    def _fence(self) -> None:
        token = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.group.broadcast(token, 60.0).wait()
        _sync(self.device)

    def raw(self) -> tuple[float, float]:
        """(start, end) of one broadcast of the flat buffer, on the system-wide monotonic clock."""
        self._fence()
        t0 = time.monotonic()
        self.group.broadcast(self.flat, 600.0).wait()
        _sync(self.device)
        return t0, time.monotonic()

    def raw_load(self) -> tuple[float, float]:
        """(start, end) of one flat broadcast and, on receivers, the load of every tensor into
        the model from views of the flat buffer (no copy besides the load itself)."""
        self._fence()
        t0 = time.monotonic()
        self.group.broadcast(self.flat, 600.0).wait()
        if self.rank:
            self.engine.load_weights(_views(self.manifest, self.flat))
        _sync(self.device)
        return t0, time.monotonic()

    def cpu_s(self) -> float:
        """This process's CPU seconds so far, every thread (the baseline's share of the machine)."""
        return time.process_time()

    def per_tensor(self) -> tuple[float, float]:
        """(start, end) of one broadcast per tensor, each loaded on arrival, as the recipe does."""
        self._fence()
        t0 = time.monotonic()
        for spec in self.manifest:
            if self.rank == 0:
                self.group.broadcast(self.tensors[spec.name], 600.0).wait()
            else:
                buf = torch.empty(spec.shape, dtype=spec.torch_dtype, device=self.device)
                self.group.broadcast(buf, 600.0).wait()
                self.engine.load_weights([(spec.name, buf)])
        _sync(self.device)
        return t0, time.monotonic()

    def model_digest(self) -> str:
        """The sender's: the digest of what it sent; a receiver's: of the model it loaded (the
        baselines must move real data). Equal digests: bit-exact models (bits.digest)."""
        if self.rank == 0:
            return self.want
        from .bits import digest

        return digest(self.engine.params)

    def close(self) -> None:
        self.group = self.store = None


def _views(manifest: Manifest, flat: torch.Tensor):
    """(name, tensor) views of the packed flat buffer, in the order prepare() packed them."""
    offset = 0
    for spec in manifest:
        n = spec.nbytes
        yield spec.name, flat[offset: offset + n].view(spec.torch_dtype).view(spec.shape)
        offset += n


def _sync(device: torch.device) -> None:
    from weightsync.device import synchronize

    synchronize(device)


def _peers(manifest: Manifest, receivers: int, backend: str, device: str, resources: dict | None,
           method: str) -> list[Any]:
    actor = ray.remote(Peer).options(num_cpus=0, **(resources or {}))
    size = receivers + 1
    peers = [actor.remote(r, size, manifest.to_wire(), backend, device) for r in range(size)]
    try:
        host, port = ray.get(peers[0].host.remote(), timeout=TIMEOUT_S)
        prefix = f"weightsync-bench/{secrets.token_hex(4)}"
        ray.get([p.join.remote(host, port, prefix) for p in peers], timeout=TIMEOUT_S)
        ray.get([p.prepare.remote(method) for p in peers], timeout=TIMEOUT_S)
    except BaseException:
        _kill(peers)
        raise
    return peers


def _timed(peers: list[Any], method: str, repeats: int, cpu: dict | None = None) -> list[float]:
    out = []
    cpu0 = sum(ray.get([p.cpu_s.remote() for p in peers], timeout=TIMEOUT_S))
    for _ in range(repeats):
        spans = ray.get([getattr(p, method).remote() for p in peers], timeout=TIMEOUT_S)
        out.append(max(e for _, e in spans) - min(s for s, _ in spans))
    if cpu is not None:
        cpu["cpu_s"] = sum(ray.get([p.cpu_s.remote() for p in peers], timeout=TIMEOUT_S)) - cpu0
    if method in ("per_tensor", "raw_load"):
        want, *got = ray.get([p.model_digest.remote() for p in peers], timeout=TIMEOUT_S)
        if any(g != want for g in got):
            raise RuntimeError(f"{method} baseline delivered wrong bytes")
    return out


def _kill(actors: list[Any]) -> None:
    for a in actors:
        try:
            ray.get(a.close.remote(), timeout=10)
        except Exception:
            pass
        ray.kill(a)


def _baseline(method: str, manifest: Manifest, receivers: int, backend: str, device: str, repeats: int,
              resources: dict | None, cpu: dict | None, keep: dict | None = None) -> list[float]:
    """``keep``: a dict the caller owns (and empties with :func:`close_kept`) in which the group
    stays between calls, so that a benchmark's rounds reuse one group instead of making the
    version's random bits again each round; without it the group goes after this call."""
    key = (method, receivers, backend, device)
    peers = keep.get(key) if keep is not None else None
    if peers is None:
        peers = _peers(manifest, receivers, backend, device, resources, method)
        if keep is not None:
            keep[key] = peers
    try:
        return _timed(peers, method, repeats, cpu)
    except BaseException:
        if keep is not None:
            keep.pop(key, None)
        _kill(peers)  # a failed group is not reused
        raise
    finally:
        if keep is None:
            _kill(peers)


def open_kept(keep: dict, method: str, manifest: Manifest, receivers: int, backend: str, device: str,
              resources: dict | None) -> None:
    """Make the group ``_baseline(..., keep=keep)`` will find, ahead of its first call."""
    keep[(method, receivers, backend, device)] = _peers(manifest, receivers, backend, device, resources, method)


def close_kept(keep: dict) -> None:
    """Kill every group a :func:`_baseline` caller kept."""
    while keep:
        _kill(keep.popitem()[1])


def raw_broadcast(manifest: Manifest, receivers: int, *, backend: str = "gloo", device: str = "cpu",
                  repeats: int = 3, resources: dict | None = None, cpu: dict | None = None,
                  keep: dict | None = None) -> list[float]:
    """Seconds of one broadcast of ``manifest.total_bytes`` pre-packed in a flat buffer."""
    return _baseline("raw", manifest, receivers, backend, device, repeats, resources, cpu, keep)


def raw_broadcast_load(manifest: Manifest, receivers: int, *, backend: str = "gloo", device: str = "cpu",
                       repeats: int = 3, resources: dict | None = None, cpu: dict | None = None,
                       keep: dict | None = None) -> list[float]:
    """Seconds of one flat broadcast plus every receiver's load of the tensors into its model."""
    return _baseline("raw_load", manifest, receivers, backend, device, repeats, resources, cpu, keep)


def per_tensor_broadcast(manifest: Manifest, receivers: int, *, backend: str = "gloo", device: str = "cpu",
                         repeats: int = 3, resources: dict | None = None, cpu: dict | None = None,
                         keep: dict | None = None) -> list[float]:
    """Seconds of one broadcast per tensor, each handed to load_weights on arrival."""
    return _baseline("per_tensor", manifest, receivers, backend, device, repeats, resources, cpu, keep)


class _BenchTrainer:
    """Sender rank 0 holding one fixed set of tensors, so timing excludes making them."""

    def __init__(self, coordinator: Any, manifest_wire: list, receivers: int):
        from weightsync.sender import WeightSender

        self.manifest = Manifest.from_wire(manifest_wire)
        self.tensors = materialize(self.manifest, seed=1)
        self.sender = WeightSender(coordinator, expected_receivers=receivers)

    def step(self, version: int) -> float:
        self.sender.stage(version, self.tensors)
        r = self.sender.sync(version)
        return r.stage_s + r.barrier_s

    def close(self) -> None:
        self.sender.close()


class _BenchRollout:
    """Receiver rank: a WeightReceiver feeding a ToyEngine, with no expected layout to check, as
    the raw baselines have none."""

    def __init__(self, coordinator: Any, manifest_wire: list, name: str, rank: int, config: dict):
        from weightsync.config import SyncConfig
        from weightsync.receiver import WeightReceiver

        self.engine = ToyEngine(Manifest.from_wire(manifest_wire))
        self.receiver = WeightReceiver(coordinator, self.engine.load_weights, name=name, rank=rank,
                                       post_load=self.engine.post_load, config=SyncConfig.load(config))

    def apply(self, version: int) -> int | None:
        return self.receiver.apply(version)

    def close(self) -> None:
        self.receiver.close()


def bucketed_broadcast(manifest: Manifest, receivers: int, *, config: dict | None = None, repeats: int = 3,
                       resources: dict | None = None) -> list[float]:
    """Seconds per version over the broadcast transport: pack, send, verify, load, commit.
    The first version (group construction, first-touch of the buffers) is not counted."""
    from weightsync.coordinator.client import Coordinator

    cfg = {"transport": "broadcast", "bucket_mb": 64.0, **(config or {})}
    coord = Coordinator.create(cfg, name=f"weightsync-bench-{os.getpid()}-{secrets.token_hex(3)}")
    opts = {"num_cpus": 0, **(resources or {})}
    workers = [ray.remote(_BenchRollout).options(**opts).remote(coord, manifest.to_wire(), f"bench-rollout-{i}",
                                                                 rank=i, config=cfg)
               for i in range(receivers)]
    trainer = ray.remote(_BenchTrainer).options(**opts).remote(coord, manifest.to_wire(), receivers)
    try:
        out = []
        for v in range(repeats + 1):
            applied = [w.apply.remote(v) for w in workers]
            seconds = ray.get(trainer.step.remote(v))
            ray.get(applied)
            if v:
                out.append(seconds)
        return out
    finally:
        _kill(workers + [trainer])
        coord.shutdown()


def compare(manifest: Manifest, receivers: int, *, config: dict | None = None, repeats: int = 3,
            per_tensor: bool = True, raw: bool = True) -> dict[str, Any]:
    """Best-of-``repeats`` seconds of each and the two ratios the broadcast issue asks for."""
    cfg = dict(config or {})
    backend = choose_backend(cfg.get("backend", "auto"), torch.device("cpu"))
    out: dict[str, Any] = {"receivers": receivers, "bytes": manifest.total_bytes, "tensors": len(manifest),
                           "backend": backend}
    out["bucketed_s"] = min(bucketed_broadcast(manifest, receivers, config=cfg, repeats=repeats))
    if raw:
        out["raw_s"] = min(raw_broadcast(manifest, receivers, backend=backend, repeats=repeats))
        out["bucketed_vs_raw"] = out["raw_s"] / out["bucketed_s"]
    if per_tensor:
        out["per_tensor_s"] = min(per_tensor_broadcast(manifest, receivers, backend=backend, repeats=repeats))
        out["speedup_vs_per_tensor"] = out["per_tensor_s"] / out["bucketed_s"]
    return out


def _cell(r: dict[str, Any], key: str) -> str:
    return f"{r[key]:.3f}s {r['bytes'] / 1e9 / r[key]:.2f}GB/s" if key in r else "-"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m weightsync_bench.collective_baselines",
                                     description="bucketed broadcast vs a raw flat broadcast and per-tensor broadcast")
    parser.add_argument("--layout", default="moe-small", help="built-in layout (see weightsync_bench.layouts)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--receivers", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--bucket-mb", type=float, default=64.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-checksum", action="store_true", help="bucketed run without per-bucket xxh3")
    parser.add_argument("--skip", choices=["raw", "per-tensor"], nargs="*", default=[])
    parser.add_argument("--json", action="store_true", help="one JSON object per receiver count")
    args = parser.parse_args(argv)

    manifest = layout(args.layout, args.dtype)
    cfg = {"bucket_mb": args.bucket_mb, "checksum": not args.no_checksum}
    started = not ray.is_initialized()
    if started:
        ray.init(include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    try:
        if not args.json:
            print(f"layout {args.layout}: {len(manifest)} tensors, {manifest.total_bytes / 1e9:.2f} GB; "
                  f"bucket {args.bucket_mb:g} MiB; checksum {'off' if args.no_checksum else 'on'}; "
                  f"{os.cpu_count()} CPU cores; best of {args.repeats}")
            heads = " ".join(f"{h:>18}" for h in ("bucketed", "raw flat", "per-tensor"))
            print(f"{'receivers':>9} {heads} {'bucketed/raw':>13} {'vs per-tensor':>14}")
        for n in args.receivers:
            r = compare(manifest, n, config=cfg, repeats=args.repeats, raw="raw" not in args.skip,
                        per_tensor="per-tensor" not in args.skip)
            r.update(layout=args.layout, bucket_mb=args.bucket_mb, checksum=not args.no_checksum,
                     cpu_cores=os.cpu_count())
            if args.json:
                print(json.dumps(r))
                continue
            ratio = f"{r['bucketed_vs_raw']:.2f}x" if "bucketed_vs_raw" in r else "-"
            speed = f"{r['speedup_vs_per_tensor']:.2f}x" if "speedup_vs_per_tensor" in r else "-"
            cells = " ".join(f"{_cell(r, k):>18}" for k in ("bucketed_s", "raw_s", "per_tensor_s"))
            print(f"{n:>9} {cells} {ratio:>13} {speed:>14}")
    finally:
        if started:
            ray.shutdown()


if __name__ == "__main__":
    main()
