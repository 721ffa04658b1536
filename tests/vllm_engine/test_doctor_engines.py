"""``weightsync doctor`` where vLLM's CPU engine (0.32.0) is installed: it lists vLLM's own
weight-transfer engines and ours, as a user runs it (the console script, a fresh process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

# vLLM's built-in names, read from its factory in a process that loads no plugin
BUILT_INS = """
import json
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory
print(json.dumps([sorted(WeightTransferEngineFactory._registry), sorted(WeightTransferTrainerFactory._registry)]))
"""


def test_doctor_lists_vllms_engines_and_weightsync():
    # importing the factory registers vLLM's own engines only: plugins load in load_general_plugins
    out = subprocess.run([sys.executable, "-c", BUILT_INS], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    worker_built_ins, trainer_built_ins = json.loads(out.stdout.strip().splitlines()[-1])
    assert {"nccl", "ipc"} <= set(worker_built_ins) and "weightsync" not in worker_built_ins
    exe = os.path.join(os.path.dirname(sys.executable), "weightsync")
    done = subprocess.run([exe, "doctor", "--json"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    engines = json.loads(done.stdout)["vllm_weight_transfer"]
    assert engines["available"] is True and engines["vllm"].startswith("0.32.0")
    assert engines["worker_engines"] == sorted([*worker_built_ins, "weightsync"])
    assert engines["trainer_engines"] == sorted([*trainer_built_ins, "weightsync"])
    assert engines["weightsync"] is True
    assert engines["reason"] == 'backend "weightsync" registered (weightsync_vllm plugin)'
