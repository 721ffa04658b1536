"""The two sides of the vllm-engine tier, each a Ray actor.

- ``VllmRollout``: vLLM's offline ``LLM`` (its real CPU engine, engine core and worker in
  this process: VLLM_ENABLE_V1_MULTIPROCESSING=0, one worker) started with
  ``weight_transfer_config={"backend": "weightsync"}``. vLLM finds the backend through
  weightsync's ``vllm.general_plugins`` entry point. The actor answers what vLLM's
  ``RayVLLMWeightSyncClient`` calls with ``LLM``'s own methods (vLLM's RLOfflineMixin);
  its finish also resets the prefix cache, which the worker-side engine cannot reach.
- ``Trainer``: Hugging Face's Qwen2ForCausalLM and the weightsync trainer engine, built by
  vLLM's ``WeightTransferTrainerFactory.trainer_init`` with vLLM's ``ModuleSource`` and
  vLLM's ``RayVLLMWeightSyncClient`` around the rollout actor.
"""

from __future__ import annotations

import copy
import os
import sys
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "vllm_gen"))
import engine as E  # noqa: E402  (tests/vllm_gen/engine.py: the model, prompts, HF reference)


class VllmRollout:
    def __init__(self, hf_config: dict, multiprocessing: bool = False):
        os.environ.update(E.ENV)
        # on: vLLM's default, the engine core and its worker in a subprocess (spawned: vLLM
        # forces spawn inside a Ray actor), which is no Ray job
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocessing else "0"
        if multiprocessing:
            # its multiprocess executor parses the bind as CPU id lists ("all" is the uniproc
            # worker's word); the machine is shared, so no binding at all
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
        from vllm import LLM

        path = E.checkpoint(hf_config)
        self.llm = LLM(model=path, skip_tokenizer_init=True, dtype="float32", enforce_eager=True, max_model_len=256,
                       block_size=E.BLOCK, enable_prefix_caching=True, seed=0, max_num_seqs=8,
                       weight_transfer_config={"backend": "weightsync"})
        self.gate: dict[str, Any] = {}

    # -- what vLLM's RayVLLMWeightSyncClient calls on the actor: LLM's own methods --
    def init_weight_transfer_engine(self, request: Any) -> None:
        self.llm.init_weight_transfer_engine(request)

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, request: Any) -> None:
        self.llm.update_weights(request)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)
        # KV blocks computed with the previous weights must not answer the next requests
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM did not reset its prefix cache after the update")

    def update_weight_version(self, version: str) -> None:
        self.llm.update_weight_version(version)

    def shutdown(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()

    # -- what the tests look at --
    def generate(self, seed: int) -> list:
        return E.generate(self.llm, seed)

    def engine_core_client(self) -> str:
        """How the LLM reaches its engine core: InprocClient (same process) or SyncMPClient
        (a subprocess, with the worker in it or below it)."""
        return type(self.llm.llm_engine.engine_core).__name__

    def weight_version(self) -> str:
        return self.llm.get_weight_version()

    def engine_state(self) -> dict:
        """The worker-side engine as the worker holds it (collective_rpc runs this there)."""
        def state(worker: Any) -> dict:
            eng = worker.weight_transfer_engine
            rec = eng.receiver
            return {"type": type(eng).__name__, "published": eng.published,
                    "receiver": None if rec is None else rec.name,
                    "receiver_version": None if rec is None else rec.version}

        return self.llm.collective_rpc(state)[0]

    def call(self, method: str, payload: Any) -> str:
        """Call one of LLM's weight-transfer methods with a raw payload; the error's text."""
        try:
            getattr(self.llm, method)(payload)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return ""


class Trainer:
    """Version v: every parameter moved by a seeded step (``engine.perturb``); keeps the
    previous version's model to compare against."""

    def __init__(self, hf_config: dict):
        self.model = E.hf_model(hf_config)
        self.previous = copy.deepcopy(self.model)
        self.engine: Any = None

    def connect(self, rollout: Any, coordinator: str, token: str, cfg: dict, receivers: int = 1) -> None:
        from vllm.distributed.weight_transfer import ModuleSource, RayVLLMWeightSyncClient, WeightTransferTrainerFactory
        from vllm.plugins import load_general_plugins
        from weightsync_vllm.info import WeightsyncTrainerInitInfo

        load_general_plugins()  # the trainer process registers the backend the way vLLM's do
        self.close()
        info = WeightsyncTrainerInitInfo(coordinator=coordinator, token=token, config=cfg, receivers=receivers,
                                         rank=0)
        self.engine = WeightTransferTrainerFactory.trainer_init(info, client=RayVLLMWeightSyncClient(rollout),
                                                                source=ModuleSource(self.model))

    def step(self, version: int) -> str:
        """Move to ``version`` and send it; the error's text ('' when it committed)."""
        self.previous.load_state_dict(self.model.state_dict())
        E.perturb(self.model, version)
        try:
            self.engine.send_weights(version)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return ""

    def revert(self) -> None:
        self.model.load_state_dict(self.previous.state_dict())

    def tamper(self, version: int, bucket: int) -> None:
        """weightsync's wire fault point (as support.parties.TrainerWorker.tamper): one
        byte of bucket ``bucket`` of ``version`` flipped after its digest was taken, before it is published."""
        from support.faults import edit_packed, tampering

        edit_packed(self.engine.sender.transport, tampering(version, bucket, "corrupt"))

    def manifest(self) -> list:
        from weightsync import build_manifest

        return build_manifest(list(self.model.state_dict().items())).to_wire()

    def diffs(self, generated: list) -> tuple[float, float]:
        return E.logprob_diffs(self.model, self.previous, generated)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None

