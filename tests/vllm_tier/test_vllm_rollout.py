"""Trainer-side Hugging Face Qwen2ForCausalLM -> rollout-side real vLLM Qwen2ForCausalLM
(0.11.0; 0.10.1 in tier vllm-0.10), in separate Ray actors, through VllmTarget.from_rollout +
WeightReceiver, over every transport; bf16, tied and untied embeddings, 3 versions each.

What vLLM must hold after version v is derived from the trainer's tensors by the fusion
vLLM's Qwen2 loader documents (stacked_params_mapping, the same at 0.10.1 and 0.11.0):
qkv_proj = cat(q, k, v), gate_up_proj = cat(gate, up), everything else by name, lm_head only
when untied."""

from __future__ import annotations

import sys

import pytest
import ray
import torch
import vllm_cpu  # noqa: E402  (tests/vllm_tier is on sys.path: pytest prepends it)
from support.parties import assert_same_weights, stop_actors

from weightsync.config import SyncConfig
from weightsync.manifest import Manifest, TensorSpec
from weightsync.receiver import WeightReceiver
from weightsync.sender import WeightSender

VERSIONS = 3
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


class HfTrainer:
    """Trainer rank 0: transformers' Qwen2ForCausalLM; version v's weights are seeded by v."""

    def __init__(self, hf_config: dict):
        from transformers import Qwen2Config, Qwen2ForCausalLM

        torch.manual_seed(0)
        self.model = Qwen2ForCausalLM(Qwen2Config(**hf_config)).to(torch.bfloat16)
        self.sender: WeightSender | None = None

    def connect(self, coord, cfg: dict) -> None:
        if self.sender is not None:
            self.sender.close()
        self.sender = WeightSender(coord, config=SyncConfig.load(cfg), expected_receivers=1)

    @torch.no_grad()
    def step(self, version: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(version)
        for p in self.model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen).to(p.dtype))
        # verl sends the state dict (lm_head included when tied, as the recipe does)
        state = self.model.state_dict()
        self.sender.stage(version, list(state.items())).wait()
        self.sender.sync(version)
        return {n: t.clone() for n, t in state.items()}

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()


class VllmRollout:
    """A rollout worker holding a real vLLM model where verl's rollout holds it. Built once
    per module (vLLM's imports and model construction are the slow part); each test
    connects a new receiver to its own coordinator."""

    def __init__(self, hf_config: dict):
        from weightsync_vllm.target import VllmTarget

        self.built = vllm_cpu.build(hf_config)
        self.target = VllmTarget.from_rollout(self.built.rollout)
        self.receiver: WeightReceiver | None = None
        self.post_loads = 0

    def connect(self, coord, cfg: dict) -> None:
        self.close()
        self.post_loads = 0
        real = self.target.post_load

        def counted() -> None:  # observes; the real process_weights_after_loading still runs
            self.post_loads += 1
            real()

        self.receiver = WeightReceiver(coord, self.target.load_weights, name="rollout-0", post_load=counted,
                                       expected=self.target.expected, config=SyncConfig.load(cfg))

    def apply(self, version: int) -> int:
        return self.receiver.apply(version)

    def params(self) -> dict[str, tuple[torch.Tensor, int]]:
        return {n: (p.detach().clone(), p.data_ptr()) for n, p in self.built.model.named_parameters()}

    def counts(self) -> int:
        return self.post_loads

    def check(self, manifest_wire: list) -> list[str]:
        return self.target.expected(Manifest.from_wire(manifest_wire))

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None


ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
ray.cloudpickle.register_pickle_by_value(vllm_cpu)


def want_in_vllm(state: dict[str, torch.Tensor], tied: bool) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in state.items():
        if name == "lm_head.weight" and tied:
            continue
        for fused, parts in FUSED.items():
            if f".{parts[0]}." in name:
                out[name.replace(parts[0], fused)] = torch.cat([state[name.replace(parts[0], p)] for p in parts])
                break
        else:
            if not any(f".{p}." in name for parts in FUSED.values() for p in parts[1:]):
                out[name] = t
    return out


@pytest.fixture(scope="module")
def parties(ray_cluster):
    """{tied: (rollout, trainer, parameters as built)}, all started at once."""
    made = {}
    for tied in (False, True):
        hf = {**vllm_cpu.QWEN2, "tie_word_embeddings": tied}
        made[tied] = (ray.remote(VllmRollout).options(num_cpus=0).remote(hf),
                      ray.remote(HfTrainer).options(num_cpus=0).remote(hf))
    try:
        built = {tied: ray.get(r.params.remote(), timeout=600) for tied, (r, _) in made.items()}
        yield {tied: (r, t, built[tied]) for tied, (r, t) in made.items()}
    finally:
        stop_actors([actor for pair in made.values() for actor in pair], timeout=30)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("transport", ["shm", "ipc", "broadcast"])
def test_hf_trainer_to_real_vllm_model(coordinator_factory, parties, transport, tied):
    rollout, trainer, built = parties[tied]
    cfg = {"transport": transport, "device": "cpu", "bucket_mb": 0.02, "sync_timeout_s": 60.0}
    coord = coordinator_factory(cfg)
    ray.get([rollout.connect.remote(coord, cfg), trainer.connect.remote(coord, cfg)], timeout=120)
    for v in range(1, VERSIONS + 1):
        applied = rollout.apply.remote(v)
        state = ray.get(trainer.step.remote(v), timeout=120)
        assert ray.get(applied, timeout=120) == v
        got, want = ray.get(rollout.params.remote()), want_in_vllm(state, tied)
        assert set(got) == set(want), set(got) ^ set(want)
        assert_same_weights({n: t for n, (t, _) in got.items()}, want, f"version {v}")
        moved = [n for n in got if got[n][1] != built[n][1]]
        assert not moved, f"version {v}: parameters replaced instead of updated in place: {moved}"
        assert ray.get(rollout.counts.remote()) == v  # process_weights_after_loading once per version
    assert coord.status().transport == transport


def test_manifest_check_against_the_real_model_names_the_tensor(parties):
    rollout = parties[False][0]
    good = [TensorSpec("model.layers.0.self_attn.q_proj.weight", "bfloat16", (32, 32))]
    assert ray.get(rollout.check.remote(Manifest(tuple(good)).to_wire())) == []
    unknown = Manifest((*good, TensorSpec("model.layers.0.mlp.router.weight", "bfloat16", (4, 32))))
    problems = ray.get(rollout.check.remote(unknown.to_wire()))
    assert len(problems) == 1 and "'model.layers.0.mlp.router.weight'" in problems[0], problems
    wrong = Manifest((TensorSpec("model.norm.weight", "bfloat16", (33,)),))
    problems = ray.get(rollout.check.remote(wrong.to_wire()))
    assert len(problems) == 1 and "'model.norm.weight'" in problems[0] and "[32]" in problems[0], problems
