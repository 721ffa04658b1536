"""Internal. The rows of ``weightsync bench --hosts N --trainer-ranks HxR``, run inside host 0 of a
hostnet.Cluster as ``python -m weightsync_bench.hosts_ranks_job`` (hosts_ranks.py starts it and
passes the plan as JSON in ``WS_BENCH_PLAN``).

Trainer ranks 0..R-1 on host 0, R..2R-1 on host 1, ... (H trainer hosts), one gloo process group
over all of them meeting at host 0's address; every tensor of one or more dimensions a
``Shard(0)`` DTensor on a 1-D CPU mesh over every rank (ranks.TrainerRank). K receivers on each
of the other hosts (ranks.rollout_class: a receiver per row's session, one engine). The
coordinators on host 0. Three rows, each a session of its own (its own coordinator), and two
baselines:

- ``gather``: every rank walks the tensors calling ``full_tensor()`` (a generator passed to
  stage()), rank 0 sends whole tensors;
- ``shards``: every rank passes its local DTensors to stage(); where relay takes rows, each
  rank sends its own rows to each head (a receiving host per trainer host) at the barrier (else the sender gathers
  them itself, and the row's ``sharded`` flags say so);
- ``shards-broadcast``: the same on transport broadcast (gloo): each rank broadcasts its rows
  over a group of its own to every receiver;
- ``ray-numpy``: what a Ray user writes for sharded weights: after the barrier every rank
  ``ray.put()``s its rows as numpy, each receiver ``ray.get()``s every rank's ref, joins each
  tensor's rows and loads them (``_ray_numpy_version``);
- ``ray-rdt-gloo``: the same over Ray Direct Transport (gloo), on parties of its own on the same
  hosts (``_rdt_version``).

A version's clock: from the ``dist.barrier()`` that ends the update on every rank until rank 0's
``sync()`` returned (every receiver committed): stage + sync. Around each version the driver
reads every link's counters (``ASK links`` on stdout, one JSON line back on stdin), so each
version says what crossed each host's link. After each version every receiver's weights are
compared with the full tensors, stepped here as the ranks step their rows.

The rows take turns: ``warmup`` untimed versions of each row first (relay builds its pairs),
then per round ``versions`` versions of each row, the order flipped every round
(rounds.round_order). The last line is ``RESULT {...}``.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import ray

from .hosts_job import link_delta, on, read_links, serve
from .ranks import TIMEOUT_S, TrainerRank, close_parties, free_port, give_up, rollout_class, wait_all
from .rdt_rows import RdtRanks, unavailable

ROWS = ("gather", "shards", "shards-broadcast", "ray-numpy", "ray-rdt-gloo")
SESSIONS = ("gather", "shards", "shards-broadcast")  # weightsync sessions; the others are what a Ray user writes instead
TRANSPORT = {"shards-broadcast": {"transport": "broadcast", "backend": "gloo"}}  # the others: the plan's (relay)


class Row:
    """One row's session and what its versions measured."""

    def __init__(self, name: str):
        self.name, self.coordinator = name, None
        self.version, self.error = 0, None
        self.versions: list[dict[str, Any]] = []
        self.pending: list = []
        self.transport: str | None = None
        self.reason: str | None = None
        self.rdt: Any = None  # ray-rdt-gloo: its own parties (rdt_rows.RdtRanks)


def _progress(text: str) -> None:
    print(f"PROGRESS {text}", flush=True)


def run(plan: dict[str, Any]) -> dict[str, Any]:
    from weightsync.coordinator.client import Coordinator

    from .bits import digest
    from .layouts import layout, materialize
    from .rounds import schedule
    from .rowkit import describe_error
    from .updates import Versions

    manifest = layout(plan["model"], plan["dtype"])
    wire, payload = manifest.to_wire(), manifest.total_bytes
    per_host, trainer_hosts = plan["ranks_per_host"], plan["trainer_hosts"]
    world, receiving = per_host * trainer_hosts, plan["receiving_hosts"]
    master = os.environ["WS_HOST_ADDRESS"]  # host 0's: rank 0 is here
    port = free_port(master)
    ranks = [ray.remote(TrainerRank).options(**on(r // per_host)).remote(wire, r, world, port, master)
             for r in range(world)]
    placed = [(h, k) for h in receiving for k in range(plan["receivers_per_host"])]
    rollout = ray.remote(rollout_class())
    rollouts = [rollout.options(**on(h)).remote(wire, f"rollout-h{h}-{k}", i, "cpu")
                for i, (h, k) in enumerate(placed)]
    hosts_of = {"ranks": [r // per_host for r in range(world)], "receivers": [h for h, _ in placed]}
    reference = Versions(materialize(manifest, seed=0))  # the full tensors, stepped as the ranks step
    cfg = plan["config"]
    rows = {name: Row(name) for name in ROWS}
    rdt = rows["ray-rdt-gloo"]
    rdt.error = unavailable("ray-rdt-gloo", "cpu")
    if rdt.error is None:  # started now, so that its parties make their models while the others do
        rdt.rdt = RdtRanks(wire, hosts_of["ranks"], hosts_of["receivers"], on)
    try:
        wait_all([r.pid.remote() for r in rollouts])
        if rdt.rdt is not None:
            rdt.rdt.ready(TIMEOUT_S)
        for row in (rows[n] for n in SESSIONS):
            row.coordinator = Coordinator.create(cfg, name=f"wsbench-hranks-{os.getpid()}-{row.name}",
                                                 actor_options=on(0))
            config = {**cfg, **TRANSPORT.get(row.name, {})}
            wait_all([r.open_row.remote(row.name, row.coordinator, config) for r in rollouts])
            wait_all([t.open.remote(row.name, row.coordinator, config, len(rollouts)) for t in ranks])
        step = 0
        for round_index, name, count in schedule(list(ROWS), plan["warmup"], plan["rounds"], plan["versions"]):
            row = rows[name]
            for _ in range(count):
                if row.error:
                    break
                step += 1
                row.version += 1
                reference.apply(step)
                try:
                    got = VERSION[name](row, ranks, rollouts, step)
                    want = digest(reference.tensors)
                    seen = ray.get([r.digest.remote() for r in (row.rdt.rollouts if row.rdt else rollouts)],
                                   timeout=TIMEOUT_S)
                    got.update(round=round_index, bit_exact=[s == want for s in seen])
                    row.versions.append(got)
                    if row.transport is None and row.coordinator is not None:
                        status = row.coordinator.status()
                        row.transport, row.reason = status.transport, status.transport_reason
                    _progress(f"{name} v{row.version}{' (warm-up)' if round_index < 0 else ''}: "
                              f"{got['seconds']:.3f} s ({got['seconds'] / (payload * 8 / plan['link_bits']):.2f}x "
                              f"link), out of each host {_mult(got['links'], 0, payload)}, into each "
                              f"{_mult(got['links'], 1, payload)} payloads"
                              f"{'' if all(got['bit_exact']) else ', receivers DIFFER'}")
                except Exception as exc:
                    row.error = describe_error(exc)
                    _progress(f"{name} v{row.version}: FAILED: {row.error}")
                    give_up(row, ranks)
    finally:
        if rdt.rdt is not None:
            rdt.rdt.close()
        close_parties(ranks, rollouts, rows)
    return {"payload": payload, "tensors": len(list(manifest)), "rank_bytes": rank_bytes(manifest, world),
            "uneven": any(s.shape and s.shape[0] % world for s in manifest),
            "hosts_of": hosts_of, "master": master,
            "rows": {name: {"error": r.error, "transport": r.transport, "transport_reason": r.reason,
                            "versions": r.versions} for name, r in rows.items()}}


def rank_bytes(manifest: Any, ranks: int) -> list[int]:
    """The bytes of each rank's rows as ``Shard(0)`` splits them (torch.chunk); a 0-dim tensor
    goes with rank 0, which sends the plain tensors."""
    from weightsync.manifest import chunk_bounds, row_bytes

    out = [0] * ranks
    for spec in manifest:
        if not spec.shape:
            out[0] += spec.nbytes
            continue
        bounds = chunk_bounds(spec.shape[0], ranks)
        for r in range(ranks):
            out[r] += (bounds[r + 1] - bounds[r]) * row_bytes(spec)
    return out


def _mult(links: list[list[int]], way: int, payload: int) -> str:
    return "/".join(f"{x[way] / payload:.2f}" for x in links)


def _version(row: Row, ranks: list, rollouts: list, update: int) -> dict[str, Any]:
    before = read_links()
    applied = [r.apply_row.remote(row.name, row.version) for r in rollouts]  # receivers wait first
    steps = [t.step.remote(row.name, row.version, update, False) for t in ranks]
    row.pending = applied + steps  # a failed version's other calls: give_up collects them
    outs = wait_all(steps)
    wait_all(applied)
    row.pending = []
    moved = link_delta(before, read_links())
    return {"version": row.version, "seconds": outs[0]["synced_s"], "staged_s": outs[0]["staged_s"],
            "barrier_s": outs[0]["barrier_s"], "ranks_synced_s": [o["synced_s"] for o in outs],
            "sharded": [o["sharded"] for o in outs], "links": moved}


def _ray_numpy_version(row: Row, ranks: list, rollouts: list, update: int) -> dict[str, Any]:
    """What a Ray user writes for sharded weights: every rank puts its rows into Ray's object
    store as numpy (after the barrier ending the update), each receiver gets every rank's ref,
    joins the rows into whole tensors and loads them. The clock: from rank 0's barrier until
    the last receiver loaded."""
    before = read_links()
    puts = [t.ray_put_rows.remote(update) for t in ranks]
    row.pending = puts
    outs = wait_all(puts)
    refs = [o["ref"] for o in outs]  # nested in a list: Ray hands the receivers the references
    loads = [r.ray_load.remote(refs) for r in rollouts]
    row.pending = loads
    ends = wait_all(loads)
    row.pending = []
    moved = link_delta(before, read_links())
    return {"version": row.version, "seconds": max(e["end"] for e in ends) - outs[0]["t0"],
            "staged_s": outs[0]["put_s"], "barrier_s": None, "ranks_synced_s": None,
            "sharded": [True] * len(ranks), "links": moved}


def _rdt_version(row: Row, ranks: list, rollouts: list, update: int) -> dict[str, Any]:
    """Ray Direct Transport over gloo (rdt_rows.RdtRanks: parties of its own on the same hosts):
    every rank's method returns its rows with ``tensor_transport="gloo"``, each receiver takes
    every rank's ref as an argument, joins the rows and loads them. The clock: from the driver's
    calls (the ranks already at the update) until the last receiver loaded."""
    before = read_links()
    got = row.rdt.version(update, TIMEOUT_S)
    moved = link_delta(before, read_links())
    return {"version": row.version, "seconds": got["seconds"], "staged_s": None, "barrier_s": None,
            "ranks_synced_s": None, "sharded": [True] * len(ranks), "links": moved}


VERSION = {"gather": _version, "shards": _version, "shards-broadcast": _version, "ray-numpy": _ray_numpy_version, "ray-rdt-gloo": _rdt_version}


def main() -> int:
    return serve(run)


if __name__ == "__main__":
    sys.exit(main())
