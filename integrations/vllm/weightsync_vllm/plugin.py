"""vLLM's ``vllm.general_plugins`` entry point (declared in pyproject.toml).

vLLM calls :func:`register` in every process it starts (API server, engine core, workers),
possibly more than once per process, before it builds its config. Registration is by
module path, so this imports neither vLLM's engine code nor ours: the engine module loads
only where ``weight_transfer_config.backend == "weightsync"``.
"""

from __future__ import annotations

from . import BACKEND


def register() -> None:
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory
    except ImportError:
        # vLLM < 0.32 (0.11 and the vllm-ascend releases on it) has no weight-transfer API
        # but loads this entry point all the same, and does not catch what a plugin raises:
        # an error here would stop every vLLM process of such an install from starting
        return

    # register_engine raises on a second registration of a name; vLLM may call plugins twice
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, "weightsync_vllm.worker", "WeightsyncWeightTransferEngine")
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, "weightsync_vllm.trainer",
                                                     "WeightsyncTrainerWeightTransferEngine")
