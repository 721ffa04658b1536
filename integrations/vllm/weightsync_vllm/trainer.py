"""The trainer side: a weightsync WeightSender driving vLLM's weight-sync control plane
(``VLLMWeightSyncClient``: vLLM's RayVLLMWeightSyncClient, HTTPVLLMWeightSyncClient, or any
object with its four methods).

One version, ``send_weights()``:
  stage(v) (the source iterated once, packed, digested)
  -> client.start_weight_update()
  -> client.update_weights({"version": v})  in a thread, beside  sender.sync(v)
     (the worker's update blocks until its bytes arrived and verified; sync returns when
     every receiver did, i.e. the coordinator committed v)
  -> client.finish_weight_update(weight_version=str(v)): the workers load v and vLLM
     labels its outputs with it
Staging comes before start: vLLM has no phase that ends an update without finishing it, so
nothing that can fail on the trainer alone may happen inside one. When v fails (SyncFailed
names the receivers and why) and a worker's update still returned, finish runs without a
version label: the worker sees v aborted, drops it and serves the previous weights, and
vLLM's update session closes (the same after any other error of sync).
"""

from __future__ import annotations

import threading
from typing import Any

from vllm.distributed.weight_transfer.base import TrainerWeightTransferEngine, VLLMWeightSyncClient, WeightSource

from weightsync.coordinator.client import Coordinator
from weightsync.sender import SyncResult, WeightSender

from .info import WeightsyncTrainerInitInfo


class WeightsyncTrainerWeightTransferEngine(TrainerWeightTransferEngine[WeightsyncTrainerInitInfo]):
    init_info_cls = WeightsyncTrainerInitInfo

    def __init__(self, *, client: VLLMWeightSyncClient, source: WeightSource | None, sender: WeightSender,
                 is_sender: bool = True, timeout_s: float = 300.0) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.sender = sender
        self.version = 0  # the newest version sent; the next send_weights() sends version + 1
        self.timeout_s = timeout_s
        self.last_result: SyncResult | None = None

    @classmethod
    def trainer_init(cls, init_info: WeightsyncTrainerInitInfo, *, client: VLLMWeightSyncClient,
                     source: WeightSource | None = None) -> WeightsyncTrainerWeightTransferEngine:
        if source is None:
            raise ValueError("the weightsync trainer engine resends the whole model each version: it needs a "
                             "WeightSource (vllm.distributed.weight_transfer.ModuleSource(model))")
        import ray

        cfg = init_info.sync_config
        coord = Coordinator.connect(init_info.coordinator, init_info.token, cfg)
        sender = WeightSender(coord, rank=init_info.rank, config=cfg, expected_receivers=init_info.receivers)
        engine = cls(client=client, source=source, sender=sender, is_sender=init_info.is_sender,
                     timeout_s=cfg.sync_timeout_s + cfg.connect_timeout_s)
        if engine.is_sender:
            ctx = ray.get_runtime_context() if ray.is_initialized() else None
            # a worker outside this Ray job (vLLM's engine core subprocess) joins it at this
            # address, and must look the coordinator up in this job's namespace: a job
            # without one has an anonymous namespace no other job can name otherwise
            client.init_weight_transfer_engine(init_info.worker_init_info(
                ctx.gcs_address if ctx else None, ctx.namespace if ctx else None))
        return engine

    def send_weights(self, version: int | None = None) -> SyncResult:
        """Send the source's weights as ``version`` (default: the last one + 1); returns
        what ``WeightSender.sync`` returns, raises its SyncFailed."""
        assert self.source is not None
        v = self.version + 1 if version is None else version
        self.sender.stage(v, iter(self.source)).wait()
        if not self.is_sender:
            self.last_result = self.sender.sync(v)
            self.version = v
            return self.last_result
        self.client.start_weight_update()
        worker: dict[str, Any] = {}

        def update() -> None:
            try:
                self.client.update_weights({"version": v})
            except BaseException as exc:  # re-raised below, after the sender's verdict
                worker["error"] = exc

        thread = threading.Thread(target=update, name=f"weightsync-vllm-update-{v}", daemon=True)
        thread.start()
        try:
            result = self.sender.sync(v)
        except Exception:  # SyncFailed, or the sender's own deadline / session errors
            thread.join(self.timeout_s)
            if not thread.is_alive() and "error" not in worker:
                self.client.finish_weight_update()  # closes vLLM's session; the worker drops v
            raise
        finally:
            self.version = max(self.version, v)
        thread.join(self.timeout_s)
        if thread.is_alive():
            raise TimeoutError(f"version {v} committed but vLLM's update_weights has not returned "
                               f"after {self.timeout_s} s")
        if "error" in worker:
            raise RuntimeError(f"version {v} committed but vLLM's update_weights failed: {worker['error']}") \
                from worker["error"]
        self.client.finish_weight_update(weight_version=str(v))
        self.last_result = result
        return result

    def shutdown(self) -> None:
        self.sender.close()
