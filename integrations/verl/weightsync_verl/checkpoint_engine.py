"""weightsync as a verl checkpoint-engine backend (verl >= 0.8): no change to verl's files:

    actor_rollout_ref.rollout.checkpoint_engine.backend=weightsync
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=weightsync_verl.checkpoint_engine
    +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.weightsync.transport=shm   # any SyncConfig key

verl's CheckpointEngineManager calls, per sync: prepare -> build_topology (driver) ->
init_process_group -> send_weights (every actor rank) || receive_weights (every rollout
worker) -> finalize. One weightsync session lives across syncs: actor rank 0 starts the
coordinator at its first ``prepare`` and the topology hands its name and token to everyone;
later calls find the parties already registered and reuse them (plan, buffers, segments).

Importing this module also gives verl's actor worker a branch for this backend
(engine_shards.py): an FSDP2 actor hands ``send_weights`` each rank's own shards, and every
rank of such a session sends its rows.

Staged ahead (weightsync_verl.stage_ahead): right after ``update_actor`` the trainer arms the
actor ranks (``arm_ahead``) and calls their ``update_weights`` for the next step: the
``send_weights`` so armed only stages, while the rollout still generates. At the step's sync
the trainer asks every rank whether that version still stands (``ahead_usable``) and tells
all of them the verdict (``keep_ahead``), so that every rank walks the parameters again, or
none does; the sync's ``send_weights`` then only completes the barrier.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import AsyncGenerator, Generator
from typing import Any

import torch
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

from weightsync import Coordinator, SyncConfig, WeightReceiver, WeightSender, transports
from weightsync.config import MiB
from weightsync.device import set_current

from . import engine_shards
from .config import plain
from .tagging import next_version

# verl's actor worker then hands send_weights each FSDP2 rank's own shards (engine_shards.py)
engine_shards.install()

BACKEND = "weightsync"
# pairs queued between the receiving thread and verl's consumer; the thread also waits at
# the end of every bucket until the consumer moved past it (see receive_weights)
QUEUE_DEPTH = 64


def engine_config(bucket_size: int, kwargs: dict[str, Any]) -> SyncConfig:
    """verl's bucket size and our default transport below the user's engine_kwargs, the
    environment on top. broadcast is the default where it exists: the rollout workers of
    verl >= 0.8 hold the model on the device, where a collective delivers straight into it."""
    defaults: dict[str, Any] = {"bucket_mb": bucket_size / MiB}
    if "broadcast" in transports.names():
        defaults["transport"] = "broadcast"
    base = SyncConfig.from_mapping(defaults)
    return SyncConfig.from_env(base=SyncConfig.from_mapping(plain(kwargs) or None, base=base))


@CheckpointEngineRegistry.register(BACKEND)
class WeightSyncCheckpointEngine(CheckpointEngine):
    """``engine_kwargs.weightsync`` holds SyncConfig keys; verl's ``update_weights_bucket_megabytes``
    is the bucket size unless ``bucket_mb`` is given."""

    def __init__(self, bucket_size: int, is_master: bool = False, **kwargs: Any):
        self.config = engine_config(bucket_size, kwargs)
        self.is_master = is_master
        self.coordinator: Coordinator | None = None
        self.party: WeightSender | WeightReceiver | None = None
        self._joined: tuple | None = None
        self._last: int | None = None
        self.served: int | None = None
        self._armed = False  # the next send_weights stages ahead (arm_ahead)
        self._ahead: int | None = None  # the version staged ahead, until the sync that sends it

    # -- topology (every sync; idempotent after the first) ---------------------------------

    def prepare(self) -> dict[str, Any] | None:
        if not self.is_master:
            return None
        if self.coordinator is None:
            self.coordinator = Coordinator.create(self.config)
        c = self.coordinator
        return {BACKEND: {"name": c.name, "token": c.token}}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int,
                       metadata: list) -> tuple[dict[str, list], dict[str, list]]:
        found = [m[BACKEND] for m in metadata[:actor_wg_world_size] if isinstance(m, dict) and BACKEND in m]
        if len(found) != 1:
            raise RuntimeError(f"expected exactly one actor worker with is_master=True to start the weightsync "
                               f"coordinator, found {len(found)}")
        session = found[0]

        def kwargs(role: str, n: int) -> dict[str, list]:
            return {"role": [role] * n, "rank": list(range(n)), "session": [session] * n,
                    "receivers": [rollout_world_size] * n}

        return kwargs("sender", actor_wg_world_size), kwargs("receiver", rollout_world_size)

    def init_process_group(self, role: str, rank: int, session: dict[str, str], receivers: int) -> None:
        key = (role, rank, session["name"], session["token"])
        if self._joined == key:
            return
        self._leave()
        coordinator = self.coordinator or Coordinator.connect(session["name"], session["token"], self.config)
        if role == "sender":
            self.party = WeightSender(coordinator, rank=rank, name=f"actor-{rank}", config=self.config,
                                      expected_receivers=receivers)
        else:
            # expected=None: this process holds no model (vLLM loads in its own worker
            # processes, reached through verl's server adapter), so names are checked there
            self.party = WeightReceiver(coordinator, self._no_consumer, name=f"rollout-{rank}", rank=rank,
                                        config=self.config)
        self._joined = key

    def finalize(self) -> None:
        """Nothing per sync: the session keeps its plan and buffers for the next version."""

    def close(self) -> None:
        """Leave the session (and stop the coordinator on actor rank 0)."""
        self._leave()
        if self.coordinator is not None:
            self.coordinator.shutdown()
            self.coordinator = None

    def _leave(self) -> None:
        if self.party is not None:
            self.party.close()
        self.party, self._joined = None, None

    # -- transfer ------------------------------------------------------------------------

    async def send_weights(self, weights: Generator[tuple[str, torch.Tensor], None, None],
                           global_steps: int | None = None) -> dict[str, Any]:
        sender = self.party
        if not isinstance(sender, WeightSender):
            raise RuntimeError("send_weights on a weightsync engine that init_process_group did not make a sender")
        if self._armed:
            self._armed = False
            return self._stage_ahead(sender, weights, global_steps)
        if self._ahead is not None:  # kept (keep_ahead): the bytes are staged; `weights` stays unread on every rank
            version, self._ahead = self._ahead, None
        else:
            version = self._last = next_version(global_steps, self._last)
            # staged on the calling thread: producing each tensor may be a collective (FSDP
            # full_tensor) that must run where verl's engine runs it
            sender.stage(version, weights)
        if not sender.sends and sender.rows is None:
            return {}  # walked in lockstep; rank 0 reports (see recipe._ActorSide.sync_rollout_weights)
        # a sharded session's rank sends its own rows (at the barrier on relay and broadcast)
        result = await asyncio.to_thread(_on_device, sender.device, sender.sync, version)
        if not sender.sends:
            return {}  # verl merges every actor rank's metrics: rank 0's stand for the version
        return {"weightsync/version": version, "weightsync/gbps": result.gbps, "weightsync/stage_s": result.stage_s,
                "weightsync/barrier_s": result.barrier_s, "weightsync/wire_bytes": result.wire_bytes,
                "weightsync/sharded": float(sender.rows is not None)}

    def _stage_ahead(self, sender: WeightSender, weights: Generator[tuple[str, torch.Tensor], None, None],
                     global_steps: int | None) -> dict[str, Any]:
        version = self._last = next_version(global_steps, self._last)
        self._ahead = None
        sender.stage(version, weights)
        if sender.withdraw(version, "staged after update_actor, but this transport moves it at the barrier"):
            return {"weightsync/staged_ahead": 0.0}
        self._ahead = version
        return {"weightsync/staged_ahead": 1.0, "weightsync/version": version}

    # -- staged ahead: called through verl's execute_checkpoint_engine, on every actor rank ----

    def arm_ahead(self) -> None:
        """The next send_weights stages only (the trainer calls it right after update_actor)."""
        self._armed = True

    def ahead_usable(self) -> bool:
        """This rank staged a version ahead and, on the sending rank, it is still STAGED (a
        receiver that died since, or a superseding version, aborted it)."""
        sender = self.party
        if self._ahead is None or not isinstance(sender, WeightSender):
            return False
        if not sender.sends:
            return True
        return sender.coordinator.metrics(self._ahead).state == "STAGED"

    def keep_ahead(self, keep: bool) -> None:
        """Every rank's verdict, the same on all: keep the version staged ahead for the next
        send_weights, or drop it (that sync stages a newer version from the tensors)."""
        if not keep:
            self._ahead = None

    async def receive_weights(self, global_steps: int | None = None) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        """Yield (name, tensor) of the next version. The tensors are views of the transport's
        buffer, not copies: a bucket's tensors stay valid until the consumer asks for the
        item after the bucket's last one (verl's vLLM adapter copies each tensor into its own
        IPC bucket as it goes). Consumers that keep tensors longer must clone them."""
        receiver = self.party
        if not isinstance(receiver, WeightReceiver):
            raise RuntimeError("receive_weights on a weightsync engine that init_process_group did not make a receiver")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue(maxsize=QUEUE_DEPTH)
        gone = threading.Event()  # the consumer stopped early: the receiving thread must give up

        def put(item: tuple) -> None:
            future = asyncio.run_coroutine_threadsafe(queue.put(item), loop)
            while True:
                try:
                    return future.result(timeout=0.5)
                except concurrent.futures.TimeoutError:
                    if gone.is_set():
                        future.cancel()
                        raise RuntimeError("the consumer of receive_weights stopped before the version was complete") from None

        def load_weights(pairs: Any) -> None:
            for pair in pairs:
                put(("pair", pair))
            moved_on = threading.Event()
            put(("bucket", moved_on))
            while not moved_on.wait(0.5):  # the buffer is reused once we return
                if gone.is_set():
                    raise RuntimeError("the consumer of receive_weights stopped before the version was complete")

        def run() -> None:
            try:
                receiver.load_weights = load_weights
                served = _on_device(receiver.device, receiver.apply, None)
                put(("end", served))
            except BaseException as exc:  # handed to the consumer, raised there
                if not gone.is_set():
                    put(("error", exc))

        worker = loop.run_in_executor(None, run)
        try:
            while True:
                kind, item = await queue.get()
                if kind == "pair":
                    yield item
                elif kind == "bucket":
                    item.set()
                elif kind == "end":
                    self.served = item
                    break
                else:
                    raise item
        finally:
            gone.set()
            while not worker.done():  # unblock the thread until it has given up
                while not queue.empty():
                    kind, item = queue.get_nowait()
                    if kind == "bucket":
                        item.set()
                await asyncio.sleep(0.01)
            receiver.load_weights = self._no_consumer

    @staticmethod
    def _no_consumer(pairs: Any) -> None:
        raise RuntimeError("weights arrived outside receive_weights")


def _on_device(device: torch.device, fn: Any, *args: Any) -> Any:
    set_current(device)  # the NPU current device is per thread
    return fn(*args)
