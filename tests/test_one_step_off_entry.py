"""``python -m weightsync_verl.one_step_off`` finds the recipe's Hydra config.

verl's source tree (every generation, v0.5.0 - v0.7.0) has ``recipe/`` as a namespace package
and ``recipe/one_step_off_policy/config/`` as a plain directory, and ``main_ppo`` declares
``@hydra.main(config_path="config", config_name="one_step_off_ppo_trainer", version_base=None)``.
CI cannot fetch verl's tree, so the test writes that layout (the decorator verbatim, a config
and a task that reports what it was given) and runs the entry point as a user does, in a
subprocess from the tree's root. The real tree: tests/verl_source/test_recipe_e2e.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("hydra")
pytest.importorskip("verl")
pytestmark = pytest.mark.verl

MAIN_PPO = '''
import json, os
import hydra
from omegaconf import OmegaConf


@hydra.main(config_path="config", config_name="one_step_off_ppo_trainer", version_base=None)
def main(config):
    with open(os.environ["E2E_REPORT"], "w") as f:
        json.dump(OmegaConf.to_container(config, resolve=True), f)
'''


def test_entry_point_composes_the_recipe_config_from_the_tree(tmp_path: Path):
    recipe = tmp_path / "recipe" / "one_step_off_policy"
    (recipe / "config").mkdir(parents=True)
    (recipe / "main_ppo.py").write_text(textwrap.dedent(MAIN_PPO))
    (recipe / "config" / "one_step_off_ppo_trainer.yaml").write_text("trainer:\n  total_epochs: 10\nrollout:\n  n: 1\n")
    report = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("WEIGHTSYNC_")}
    env.update(E2E_REPORT=str(report), PYTHONPATH=os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "weightsync_verl.one_step_off", "rollout.n=4", "+weightsync.transport=shm"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    config = json.loads(report.read_text())
    assert config == {"trainer": {"total_epochs": 10}, "rollout": {"n": 4}, "weightsync": {"transport": "shm"}}
