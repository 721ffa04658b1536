"""The two sides of the gen tier, each a Ray actor: a trainer holding Hugging Face's
Qwen2ForCausalLM (a WeightSender), and a rollout holding a real, generating vLLM engine
(offline ``LLM``, engine in the actor's process) fed by a WeightReceiver through
``VllmTarget``."""

from __future__ import annotations

import copy
from typing import Any

import engine as E

from weightsync.config import SyncConfig
from weightsync.receiver import WeightReceiver
from weightsync.sender import WeightSender


class Trainer:
    """Version v: every parameter moved by a seeded step (``engine.perturb``). Keeps the
    previous version's model, to show that generations after a sync differ from it."""

    def __init__(self, hf_config: dict):
        self.model = E.hf_model(hf_config)
        self.previous = copy.deepcopy(self.model)
        self.sender: WeightSender | None = None

    def connect(self, coord, cfg: dict) -> None:
        self.close()
        self.sender = WeightSender(coord, config=SyncConfig.load(cfg), expected_receivers=1)

    def step(self, version: int) -> None:
        """Move to ``version`` and send it; raises what ``sync`` raises (SyncFailed)."""
        self.previous.load_state_dict(self.model.state_dict())
        E.perturb(self.model, version)
        state = self.model.state_dict()  # lm_head included when tied, as verl sends it
        self.sender.stage(version, list(state.items())).wait()
        self.sender.sync(version)

    def revert(self) -> None:
        """Back to the previous version (its sync failed: the rollout may still serve it)."""
        self.model.load_state_dict(self.previous.state_dict())

    def diffs(self, generated: list) -> tuple[float, float]:
        """Max abs difference of the rollout's sampled-token logprobs from this trainer's,
        with the current weights and with the previous version's."""
        return E.logprob_diffs(self.model, self.previous, generated)

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
            self.sender = None


class Rollout:
    """A real vLLM engine in this process, built once per test module (import and start are
    the slow part); each test connects a new receiver to its own coordinator."""

    def __init__(self, hf_config: dict):
        from weightsync_vllm.target import VllmTarget

        self.llm = E.start_llm(E.checkpoint(hf_config))
        self.target = VllmTarget.from_llm(self.llm)
        self.receiver: WeightReceiver | None = None

    def connect(self, coord, cfg: dict, reset: bool = True, fail_at: bool = False) -> None:
        """``reset=False``: a receiver that loads and post-loads but never resets the prefix
        cache (the negative test). ``fail_at``: its loader can be made to fail (fail_next)."""
        self.close()
        config = SyncConfig.load(cfg)
        if reset and not fail_at:
            # the engine target as a whole: load, post-load, prefix-cache reset, manifest check
            self.receiver = WeightReceiver(coord, self.target, name="rollout-0", config=config)
            return
        self.failing = _Failing(self.target.load_weights)
        load = self.target.load_weights if not fail_at else self.failing
        self.receiver = WeightReceiver(coord, load, name="rollout-0", config=config, post_load=self.target.post_load,
                                       expected=self.target.expected, abort_load=self.target.abort_load,
                                       reset_cache=self.target.reset_cache if reset else None)

    def fail_next(self, k: int) -> None:
        self.failing.left = k

    def apply(self, version: int) -> tuple[int | None, str]:
        try:
            return self.receiver.apply(version), ""
        except Exception as exc:
            return self.receiver.version, f"{type(exc).__name__}: {exc}"

    def version(self) -> int | None:
        return self.receiver.version

    def generate(self, seed: int) -> list:
        return E.generate(self.llm, seed)

    def reset(self) -> Any:
        return self.llm.reset_prefix_cache()

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None


class _Failing:
    """A loader that, once armed with ``k``, fails at tensor k of the next version it loads
    (tensors 0..k-1 go into the engine's loader first); the rollback then loads normally."""

    def __init__(self, load):
        self.load, self.left = load, None

    def __call__(self, pairs):
        pairs = list(pairs)
        if self.left is not None and self.left < len(pairs):
            self.load(pairs[:self.left])  # vLLM takes these: the model is now a mix of versions
            self.left = None
            raise RuntimeError("injected: loader fails at tensor k")
        if self.left is not None:
            self.left -= len(pairs)
        return self.load(pairs)
