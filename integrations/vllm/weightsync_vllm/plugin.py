"""vLLM's ``vllm.general_plugins`` entry point (declared in pyproject.toml).

vLLM calls :func:`register` in every process it starts (API server, engine core, workers),
possibly more than once per process, before it builds its config. Registration is by
module path, so this imports neither vLLM's engine code nor ours: the engine module loads
only where ``weight_transfer_config.backend == "weightsync"``.

Which worker engine depends on the API generation of the installed vLLM:

- vLLM >= 0.32: engines own start / update / finish (:mod:`weightsync_vllm.worker`), and
  the trainer side has engines too (:mod:`weightsync_vllm.trainer`)
- vLLM 0.23 (vllm-ascend 0.23 runs on it): the worker owns the phases, the engine only
  receives (:mod:`weightsync_vllm.worker_v0_23`); no trainer engines
- older (0.11 and the vllm-ascend releases on it): no weight-transfer API, nothing registered
"""

from __future__ import annotations

from . import BACKEND

WORKER_ENGINES = {  # does vLLM's WeightTransferEngine have start_weight_update -> (module, class)
    True: ("weightsync_vllm.worker", "WeightsyncWeightTransferEngine"),
    False: ("weightsync_vllm.worker_v0_23", "WeightsyncReceiveEngine"),
}
TRAINER_ENGINE = ("weightsync_vllm.trainer", "WeightsyncTrainerWeightTransferEngine")


def register() -> None:
    try:
        from vllm.distributed.weight_transfer.base import WeightTransferEngine
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:
        # vLLM < 0.23 has no weight-transfer API but loads this entry point all the same,
        # and does not catch what a plugin raises: an error here would stop every vLLM
        # process of such an install from starting
        return

    # register_engine raises on a second registration of a name; vLLM may call plugins twice
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            BACKEND, *WORKER_ENGINES[hasattr(WeightTransferEngine, "start_weight_update")])
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    except ImportError:  # vLLM 0.23: trainers call their engine's static trainer_send_weights
        return
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, *TRAINER_ENGINE)
