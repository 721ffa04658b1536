"""weightsync as a vLLM weight-transfer engine (``vllm.distributed.weight_transfer``: vLLM >= 0.32,
and vLLM 0.23, the one vllm-ascend 0.23 runs on).

``weight_transfer_config={"backend": "weightsync"}`` picks it: :mod:`weightsync_vllm.plugin`
registers it from vLLM's ``vllm.general_plugins`` entry point, which vLLM loads in every
process it starts. Nothing here imports vLLM until vLLM asks for the engine; the main
``weightsync`` package never imports this one.

- :mod:`weightsync_vllm.info`: the typed init / update records both sides exchange
- :mod:`weightsync_vllm.worker`: the worker-side engine (a WeightReceiver in vLLM's worker)
- :mod:`weightsync_vllm.worker_v0_23`: the same for vLLM 0.23's API, where the worker owns the phases
- :mod:`weightsync_vllm.trainer`: the trainer-side engine (drives a WeightSender and vLLM's
  start / update / finish through a ``VLLMWeightSyncClient``)
- :mod:`weightsync_vllm.target`: ``VllmTarget``, a vLLM model as a receiver's target (its
  ``load_weights``, post-load processing, prefix-cache reset and manifest check), which the
  worker engine and the verl adapter both use
"""

BACKEND = "weightsync"
