"""Real vLLM model code (0.11.0, or 0.10.1 in tier vllm-0.10) on a CPU: the rollout side of the vllm tiers.

vLLM installed with ``VLLM_TARGET_DEVICE=empty`` (scripts/vllm_env.sh) has its Python model
code but no kernels and no platform of its own here; on Ascend, vllm-ascend's platform plugin
is made current before the model is built. Here vLLM's own ``CpuPlatform`` takes that place,
and it must be current before any other vLLM import (modules bind ``current_platform`` when
they are imported). Forward passes are out of scope: only construction, ``load_weights`` and
``process_weights_after_loading``, which is all weight sync touches.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
from types import SimpleNamespace
from typing import Any

# a tiny Qwen2 (vocab 256, 2 layers, GQA 4 heads / 2 kv heads of 8)
QWEN2 = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 256, "hidden_size": 32,
    "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu",
    "torch_dtype": "bfloat16", "use_sliding_window": False, "attention_dropout": 0.0,
}


def use_cpu_platform() -> None:
    import vllm.platforms as platforms

    if platforms._current_platform is None:
        from vllm.platforms.cpu import CpuPlatform

        platforms._current_platform = CpuPlatform()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build(hf_config: dict[str, Any], dtype: str = "bfloat16") -> SimpleNamespace:
    """A real vLLM model of ``hf_config`` with dummy weights, inside a stand-in of the objects
    verl's rollout holds it in (``inference_engine.worker.model_runner.model``: vLLM's
    WorkerWrapperBase -> V1 Worker -> GPUModelRunner at 0.10.1 and 0.11.0 alike, which need a
    device to exist; on Ascend vllm-ascend's NPUWorker -> NPUModelRunner sit there).
    Returns ``SimpleNamespace(rollout=..., model=..., runner=...)``."""
    use_cpu_platform()
    import torch
    from vllm.config import DeviceConfig, LoadConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.model_loader import get_model

    path = tempfile.mkdtemp(prefix="weightsync-vllm-")
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(hf_config, fh)
    model_config = ModelConfig(model=path, dtype=dtype, skip_tokenizer_init=True, seed=0)
    vllm_config = VllmConfig(model_config=model_config, load_config=LoadConfig(load_format="dummy"),
                             device_config=DeviceConfig("cpu"))
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(1, 0, f"tcp://127.0.0.1:{_free_port()}", 0, backend="gloo")
        initialize_model_parallel(1, 1)
        model = get_model(vllm_config=vllm_config)
    runner = SimpleNamespace(model=model, model_config=model_config, vllm_config=vllm_config,
                             device=torch.device("cpu"))
    rollout = SimpleNamespace(inference_engine=SimpleNamespace(worker=SimpleNamespace(model_runner=runner)))
    return SimpleNamespace(rollout=rollout, model=model, runner=runner, config=vllm_config)
