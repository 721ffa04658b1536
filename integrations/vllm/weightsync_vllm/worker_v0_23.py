"""The worker side for vLLM 0.23's weight-transfer API, the one vllm-ascend 0.23's NPUWorker
drives (vllm_ascend/worker/worker.py at 0.23.0.post1, NPUWorker.load_model and
init_weight_transfer_engine ... finish_weight_update). There the worker, not the engine, owns
the phases:

- ``WeightTransferEngineFactory.create_engine(config, parallel_config, model)``: three
  arguments (vLLM >= 0.32 passes vllm_config and device as well)
- ``init_weight_transfer_engine(d)``: ``engine.init_transfer_engine(engine.parse_init_info(d))``
- ``start_weight_update(is_checkpoint_format=True)``: the worker opens vLLM's layerwise reload
- ``update_weights(d)``: ``engine.receive_weights(engine.parse_update_info(d),
  load_weights=model.load_weights)`` under ``torch.device(worker.device)``, then
  ``torch.npu.synchronize()``; with ``is_checkpoint_format=False`` load_weights is the worker's
  own copy by parameter name instead
- ``finish_weight_update()``: the worker finalizes the reload

So the engine's ``receive_weights`` does what the phased engine spreads over update and finish:
``receiver.apply(v)`` (manifest checked, every bucket verified, tensors staged: the model is
untouched), then the coordinator's outcome for v, and only a committed v goes through the
``load_weights`` vLLM passed. An aborted v loads nothing: vLLM 0.23's
``finalize_layerwise_processing`` puts a layer's kernel tensors back when a reload loaded
nothing into it, so the model keeps serving the previous version.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine

from weightsync.errors import SyncFailed
from weightsync.receiver import WeightReceiver

from .info import WeightsyncInitInfo, WeightsyncUpdateInfo
from .worker import StagingTarget, attach, stage_version

log = logging.getLogger("weightsync.vllm")


class WeightsyncReceiveEngine(WeightTransferEngine[WeightsyncInitInfo, WeightsyncUpdateInfo]):
    init_info_cls = WeightsyncInitInfo
    update_info_cls = WeightsyncUpdateInfo

    def __init__(self, config: Any, parallel_config: Any, model: torch.nn.Module) -> None:
        super().__init__(config, parallel_config, model)
        self.receiver: WeightReceiver | None = None
        self.target: StagingTarget | None = None
        self.published: int | None = None  # the version the model holds, as receive_weights loaded it

    def init_transfer_engine(self, init_info: WeightsyncInitInfo) -> None:
        self.receiver, self.target = attach(self.model, self.parallel_config, init_info, self.receiver)

    def receive_weights(self, update_info: WeightsyncUpdateInfo,
                        load_weights: Callable[[list[tuple[str, torch.Tensor]]], None]) -> None:
        if self.receiver is None or self.target is None:
            raise RuntimeError("weightsync: init_weight_transfer_engine has not attached this worker to a coordinator")
        receiver, target, v = self.receiver, self.target, update_info.version
        if load_weights != self.model.load_weights:
            # weightsync sends checkpoint names (the manifest check maps them through the
            # model's packed_modules_mapping); the worker's direct copy wants vLLM's own names
            raise RuntimeError(f"weightsync receiver '{receiver.name}': version {v} needs "
                               f"start_weight_update(is_checkpoint_format=True) (weightsync sends checkpoint names)")
        target.drop()
        sealed = stage_version(receiver, target, v, update_info.timeout_s, self.published)
        target.drop()
        timeout = update_info.timeout_s or receiver.config.sync_timeout_s
        try:
            receiver.control.wait_outcome(v, timeout)
        except SyncFailed as exc:
            # a peer failed after this worker verified v: nothing is loaded, finish keeps the model
            log.warning("weightsync receiver '%s': version %s aborted (%s); vLLM keeps serving version %s",
                        receiver.name, v, exc, self.published)
            return
        load_weights(sealed)
        self.published = v

    @staticmethod
    def trainer_send_weights(iterator: Iterator[tuple[str, torch.Tensor]], trainer_args: Any) -> None:
        raise NotImplementedError("weightsync's trainer side is a WeightSender: sender.sync(v) beside the workers' "
                                  "update_weights({'version': v}) (docs/vllm.md)")

    def shutdown(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None
        if self.target is not None:
            self.target.drop()
