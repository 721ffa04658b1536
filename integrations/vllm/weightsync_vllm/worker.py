"""The worker side for vLLM >= 0.32, whose engines own the start / update / finish phases: a
weightsync WeightReceiver inside vLLM's worker, driven by those phases
(``vllm.v1.worker.gpu_worker.Worker``; vLLM's CPUWorker inherits them). vLLM 0.23's API, where
the worker owns the phases (vllm-ascend 0.23's NPUWorker), is :mod:`weightsync_vllm.worker_v0_23`.

- ``init_transfer_engine``: attach a receiver to the coordinator (by name; Ray is joined
  first where the worker's process is not in a Ray job yet)
- ``start_weight_update``: open a version; nothing staged from an earlier one survives
- ``update_weights({"version": v})``: ``receiver.apply(v)``: the manifest checked against
  the model, every bucket's digest verified, the tensors copied aside (staged). The model
  is not touched: a version that fails here (a corrupt bucket, a dead peer, a timeout)
  leaves vLLM serving the weights it had, on every transport
- ``finish_weight_update``: the version is published only if the coordinator committed it
  (every receiver verified it); then the staged tensors go through vLLM's layerwise reload,
  the same path vLLM's IPC engine takes. A version the coordinator aborted (a peer failed
  after this worker verified it) is dropped here and the model keeps the previous one.

The prefix cache lives in the engine core's scheduler, out of the worker's reach: whoever
calls ``finish_weight_update`` resets it afterwards (``LLM.reset_prefix_cache()``, the
server's ``/reset_prefix_cache``), or requests after the update reuse KV blocks computed
with the old weights.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine

from weightsync.coordinator.client import Coordinator
from weightsync.receiver import WeightReceiver
from weightsync.records import State

from .info import WeightsyncInitInfo, WeightsyncUpdateInfo
from .target import fused_check

log = logging.getLogger("weightsync.vllm")


class StagingTarget:
    """The WeightReceiver's engine target in the worker: buckets are copied aside (their
    tensors are views of transport buffers, reused by the next bucket); ``post_load`` seals
    the version's tensors for ``finish``; the manifest check is the one VllmTarget uses
    (names through the model's ``packed_modules_mapping``, shapes against its parameters)."""

    def __init__(self, model: torch.nn.Module):
        self.expected = fused_check(model)
        self._staged: list[tuple[str, torch.Tensor]] = []
        self.sealed: list[tuple[str, torch.Tensor]] | None = None

    @torch.no_grad()
    def load_weights(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._staged.extend((n, t.clone()) for n, t in pairs)

    def post_load(self) -> None:
        self.sealed, self._staged = self._staged, []

    def abort_load(self) -> None:
        self._staged = []

    def drop(self) -> None:
        self._staged, self.sealed = [], None


def attach(model: torch.nn.Module, parallel_config: Any, init_info: WeightsyncInitInfo,
           previous: WeightReceiver | None) -> tuple[WeightReceiver, StagingTarget]:
    """A WeightReceiver for this worker (``<receiver>-<global rank>``) on the coordinator the
    init info names, replacing ``previous``; Ray is joined first where the worker's process
    is not in a Ray job. Both API generations' engines attach through here."""
    import ray
    from vllm.distributed.parallel_state import get_world_group

    if not ray.is_initialized():
        if init_info.ray_address is None:
            raise RuntimeError("weightsync: this vLLM worker is not in a Ray job and the init info has no "
                               "`ray_address` to join one (the trainer fills it from its own Ray job)")
        # vLLM's engine core subprocess: join the trainer's cluster to reach the coordinator
        ray.init(address=init_info.ray_address, namespace=init_info.sync_config.namespace or None,
                 log_to_driver=False, logging_level="ERROR")
    if previous is not None:
        previous.close()
    coord = Coordinator.connect(init_info.coordinator, init_info.token, init_info.sync_config)
    target = StagingTarget(model)
    rank = parallel_config.data_parallel_index * parallel_config.world_size + get_world_group().rank_in_group
    receiver = WeightReceiver(coord, target, name=f"{init_info.receiver}-{rank}", rank=rank,
                              config=init_info.sync_config)
    return receiver, target


def stage_version(receiver: WeightReceiver, target: StagingTarget, v: int, timeout: float | None,
                  published: int | None) -> list[tuple[str, torch.Tensor]]:
    """Receive and verify version ``v`` into ``target`` (the model untouched); its staged pairs.
    On any failure the staging is dropped and the error says vLLM keeps ``published``."""
    try:
        got = receiver.apply(v, timeout=timeout)
    except BaseException as exc:
        target.drop()
        raise RuntimeError(f"weightsync receiver '{receiver.name}' failed version {v}: {type(exc).__name__}: "
                           f"{exc}; vLLM keeps serving version {published}") from exc
    if got != v or target.sealed is None:
        target.drop()
        raise RuntimeError(f"weightsync receiver '{receiver.name}' asked for version {v} and got {got}; "
                           f"vLLM keeps serving version {published}")
    return target.sealed


class WeightsyncWeightTransferEngine(WeightTransferEngine[WeightsyncInitInfo, WeightsyncUpdateInfo]):
    init_info_cls = WeightsyncInitInfo
    update_info_cls = WeightsyncUpdateInfo
    # the manifest check is bound to the main model at init
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.receiver: WeightReceiver | None = None
        self.target: StagingTarget | None = None
        self.published: int | None = None  # the version the model holds, as finish loaded it
        self._verified: int | None = None  # the version of this update, staged and verified

    @property
    def name(self) -> str:
        return self.receiver.name if self.receiver is not None else "(weightsync receiver not attached)"

    def init_transfer_engine(self, init_info: WeightsyncInitInfo) -> None:
        self.receiver, self.target = attach(self.model, self.parallel_config, init_info, self.receiver)
        self._verified = None

    def _attached(self) -> tuple[WeightReceiver, StagingTarget]:
        if self.receiver is None or self.target is None:
            raise RuntimeError("weightsync: init_weight_transfer_engine has not attached this worker to a coordinator")
        return self.receiver, self.target

    def start_weight_update(self) -> None:
        _, target = self._attached()
        target.drop()
        self._verified = None

    def receive_weights(self, update_info: WeightsyncUpdateInfo) -> None:
        receiver, target = self._attached()
        v = update_info.version
        if self._verified is not None:
            raise RuntimeError(f"weightsync receiver '{receiver.name}': version {self._verified} is already staged "
                               f"in this update; one version per start / finish")
        stage_version(receiver, target, v, update_info.timeout_s, self.published)
        self._verified = v

    def finish_weight_update(self) -> None:
        receiver, target = self._attached()
        v, sealed = self._verified, target.sealed
        self._verified = None
        target.drop()
        if v is None or sealed is None:
            raise RuntimeError(f"weightsync receiver '{receiver.name}': finish without a verified version "
                               f"(no update_weights since start, or it failed)")
        state = receiver.control.state(v)
        if state.state != State.COMMITTED:
            # a peer failed after this worker verified v: the model keeps what it serves
            log.warning("weightsync receiver '%s': version %s is %s (%s); vLLM keeps serving version %s",
                        receiver.name, v, state.state, state.reason, self.published)
            return
        self._load(sealed)
        self.published = v

    @torch.no_grad()
    def _load(self, pairs: list[tuple[str, torch.Tensor]]) -> None:
        # vLLM's layerwise reload (as its IPC engine does across start / finish): the model
        # may hold repacked weights (oneDNN on CPU, quantized kernels) that a direct
        # load_weights would not reach
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        initialize_layerwise_reload(self.model)
        self.model.load_weights(iter(pairs))
        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # the base class synchronizes the accelerator after receive_weights; a staged
        # version has nothing on the device yet, and on CPU torch.accelerator may be absent
        self.receive_weights(self.parse_update_info(update_info))

    def shutdown(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None
        if self.target is not None:
            self.target.drop()
