"""The user's one-step-off run, sized down for CPU: verl's recipe (from the tree in
WSTEST_VERL_SRC) started as the user starts it, ``python -m weightsync_verl.one_step_off
<overrides>``, with verl's own async vLLM server (vLLM's real CPU engine, started by the
server through verl's ExternalZeroMQDistributedExecutor into the rollout worker), an FSDP2
actor on 2 CPU ranks, a tiny fp32 Qwen2, a synthetic dataset in verl's parquet format and the
rule reward in e2e_reward.py. The only additions to the user's process are the CPU shims of
e2e_site/sitecustomize.py (see there).

Also a script, to make the figures of docs/end-to-end.md:
    WSTEST_VERL_SRC=<tree> <venv>/bin/python tests/verl_source/e2e_run.py <out dir> [steps]
writes <out dir>/run.log, metrics.jsonl (verl's per-step metrics, parsed from its console log),
capture/ (every synced version's weights and every step's batch, see e2e_site/sitecustomize.py)
and parity.jsonl (the per-step, per-version logprob parity of e2e_parity.py).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
WORDS = 64  # the tokenizer's length is the model's vocab: vLLM masks logits past len(tokenizer)
PREFIX = 20  # words every prompt shares: more than one 16-token KV block, so vLLM caches them


def tiny_qwen2(path: Path) -> Path:
    """A 2-layer Qwen2 (hidden 128, fp32) with a word-level tokenizer and a chat template."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    words = ["<pad>", "<eos>"] + [f"w{i}" for i in range(WORDS - 2)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    fast.save_pretrained(path)
    cfg = Qwen2Config(vocab_size=WORDS, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                      tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, bos_token_id=1, torch_dtype="float32")
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).to(torch.float32).save_pretrained(path, safe_serialization=True)
    return path


def dataset(path: Path, rows: int, seed: int) -> Path:
    """verl's RL parquet layout (data_source, prompt as chat messages, ability, reward_model,
    extra_info); every prompt is the shared prefix plus three words of its own."""
    import random

    import pandas as pd

    rng = random.Random(seed)
    prefix = " ".join(f"w{i}" for i in range(PREFIX))
    records = []
    for i in range(rows):
        own = " ".join(f"w{rng.randrange(WORDS - 2)}" for _ in range(3))
        records.append({"data_source": "weightsync_e2e", "prompt": [{"role": "user", "content": f"{prefix} {own}"}],
                        "ability": "even_words", "reward_model": {"style": "rule", "ground_truth": "even"},
                        "extra_info": {"index": i, "split": path.stem}})
    pd.DataFrame(records).to_parquet(path)
    return path


def overrides(work: Path, steps: int, name: str) -> list[str]:
    model = tiny_qwen2(work / "qwen2-tiny")
    train, val = dataset(work / "train.parquet", 4 * steps, 0), dataset(work / "val.parquet", 4, 1)
    return [
        # the user's command (README, issue 14) ...
        "algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.strategy=fsdp2", "critic.strategy=fsdp2",
        "actor_rollout_ref.hybrid_engine=False", "actor_rollout_ref.actor.fsdp_config.param_offload=True",
        "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.mode=async",
        "actor_rollout_ref.rollout.load_format=safetensors", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "rollout.n_gpus_per_node=1", "rollout.nnodes=1", "trainer.nnodes=1",
        "actor_rollout_ref.rollout.calculate_log_probs=True",  # rollout log-probs on: verl's mismatch metrics
        # the recipe's yaml sets bypass mode (old_log_prob := the rollout's log-probs); decoupled
        # mode has the actor recompute old_log_prob, which verl then compares with the rollout's
        "algorithm.rollout_correction.bypass_mode=False",
        "actor_rollout_ref.rollout.enable_prefix_caching=True",
        # ... sized down for 2 CPU cores: device, ranks, model, data, lengths
        "trainer.device=cpu", "trainer.n_gpus_per_node=2",
        f"actor_rollout_ref.model.path={model}", "actor_rollout_ref.model.use_remove_padding=False",
        "+actor_rollout_ref.model.override_config.attn_implementation=eager",
        "actor_rollout_ref.rollout.dtype=float32", "actor_rollout_ref.actor.fsdp_config.dtype=float32",
        # vLLM's CPU platform has no sleep mode (its ModelConfig refuses enable_sleep_mode)
        "+actor_rollout_ref.rollout.enable_sleep_mode=False", "actor_rollout_ref.rollout.free_cache_engine=False",
        "actor_rollout_ref.rollout.enforce_eager=True", "+actor_rollout_ref.rollout.engine_kwargs.vllm.block_size=16",
        "actor_rollout_ref.rollout.agent.num_workers=1", "actor_rollout_ref.rollout.n=4",
        f"data.train_files={train}", f"data.val_files={val}", "data.prompt_key=prompt", "data.return_raw_chat=True",
        "data.max_prompt_length=32", "data.max_response_length=16", "data.train_batch_size=4",
        "data.dataloader_num_workers=0",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4", "actor_rollout_ref.actor.optim.lr=1e-3",
        "actor_rollout_ref.actor.use_kl_loss=False", "algorithm.use_kl_in_reward=False",
        f"custom_reward_function.path={HERE / 'e2e_reward.py'}", "custom_reward_function.name=compute_score",
        f"trainer.total_training_steps={steps}", "trainer.total_epochs=1", "trainer.val_before_train=False",
        "trainer.test_freq=-1", "trainer.save_freq=-1", "trainer.logger=[console]",
        "trainer.project_name=weightsync-e2e", f"trainer.experiment_name={name}",
        f"trainer.default_local_dir={work / 'checkpoints'}",
        # Ray: logical resources: the task runner asks 10 CPUs, each rank a bundle of {CPU: 3, cpu: 1}
        # (RayResourcePool, max_colocate_count=3), plus the vLLM server and agent-loop actors
        "ray_kwargs.ray_init.num_cpus=32", "+ray_kwargs.ray_init.num_gpus=4", "+ray_kwargs.ray_init.resources={cpu:4}",
        "+ray_kwargs.ray_init.object_store_memory=600000000", "+ray_kwargs.ray_init.include_dashboard=False",
        # weightsync in place of the recipe's NCCL group
        "+weightsync.transport=shm", "+weightsync.device=cpu", f"+weightsync.coordinator_name=ws-e2e-{name}",
        "+weightsync.sync_timeout_s=300", "+weightsync.connect_timeout_s=300", "+weightsync.heartbeat_timeout_s=30",
    ]


def run(src: str, work: Path, steps: int = 5, timeout: float = 1800,
        extra_env: dict[str, str] | None = None) -> tuple[list[dict], float]:
    """Runs the user's command; returns verl's per-step metrics and the wall time (s)."""
    work.mkdir(parents=True, exist_ok=True)
    name = f"e2e-{os.getpid()}-{int(time.time())}"
    args = overrides(work, steps, name)
    env = {k: v for k, v in os.environ.items() if not k.startswith("WEIGHTSYNC_")}
    (work / "capture").mkdir(exist_ok=True)
    env.update(E2E_CAPTURE_DIR=str(work / "capture"),
               PYTHONPATH=os.pathsep.join([str(HERE / "e2e_site"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false",
               RAY_DEDUP_LOGS="0", **(extra_env or {}))
    t0 = time.perf_counter()
    with open(work / "run.log", "w") as log:
        proc = subprocess.run([sys.executable, "-m", "weightsync_verl.one_step_off", *args], cwd=src, env=env,
                              stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = (work / "run.log").read_text()[-6000:]
        raise RuntimeError(f"the run exited {proc.returncode} after {wall:.0f} s; log {work / 'run.log'}:\n{tail}")
    rows = parse_console((work / "run.log").read_text())
    (work / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows, wall


def parse_console(log: str) -> list[dict]:
    """verl's per-step metrics from its console logger: ``step:<s> - <key>:<value> - ...``
    (its file logger cannot write this run's metrics: one of them is a tensor, not JSON)."""
    rows = []
    for match in re.finditer(r"step:(\d+) - (.*)", log):
        row: dict = {"step": int(match.group(1))}
        for item in match.group(2).split(" - "):
            key, _, value = item.strip().rpartition(":")
            try:
                row[key] = float(value)
            except ValueError:
                row[key] = value
        rows.append(row)
    return rows


def main() -> None:
    src = os.environ["WSTEST_VERL_SRC"]
    out = Path(sys.argv[1]).resolve()
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    rows, wall = run(src, out, steps)
    print(f"{len(rows)} steps in {wall:.0f} s; metrics in {out / 'metrics.jsonl'}")
    from e2e_parity import per_step  # run as a script: this directory is on sys.path

    parity = per_step(out / "capture", out / "qwen2-tiny")
    (out / "parity.jsonl").write_text("".join(json.dumps(r) + "\n" for r in parity))
    for r in parity:
        print(r)


if __name__ == "__main__":
    main()
