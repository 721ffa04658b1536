"""What a user brings to a verl run, made locally (no hub access in CI): a tiny Qwen2 in fp32
with a byte-level Qwen2 tokenizer (one token per byte, no merges) and a chat template, a small
prompt dataset in verl's parquet format, and a rule reward (``compute_score``, the name verl's
``custom_reward_function`` looks up).

Why byte-level Qwen2: transformers 5 loads the tokenizer of a ``qwen2`` model as
``Qwen2Tokenizer`` whatever tokenizer_config says, and verl's Qwen token builder requires
"\\n" to be one token."""

from __future__ import annotations

import os

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ChatML, as verl's Qwen token builder requires
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TARGET = "abcdefghijklmnopqrstuvwxyz"  # the characters the reward asks for (~10% of a random byte stream)


def make_model(path: str, seed: int = 0) -> str:
    """A 2-layer Qwen2 (hidden 128, head_dim 64: vLLM's CPU attention rejects 16; vocab = the tokenizer's 259: verl's vLLM server bans ids past len(tokenizer), which shifts the rollout's log-probs, untied
    embeddings) in fp32 and its tokenizer."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    os.makedirs(path, exist_ok=True)
    vocab = {c: i for i, c in enumerate(bytes_to_unicode().values())}
    for s in SPECIAL:
        vocab[s] = len(vocab)
    tok = Qwen2Tokenizer(vocab=vocab, merges=[], pad_token="<|endoftext|>", eos_token="<|im_end|>",
                         unk_token=None, bos_token=None)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)
    config = Qwen2Config(vocab_size=len(vocab), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                         tie_word_embeddings=False, torch_dtype="float32", bos_token_id=None,
                         eos_token_id=vocab["<|im_end|>"], pad_token_id=vocab["<|endoftext|>"])
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.float32)
    model.generation_config.eos_token_id = vocab["<|im_end|>"]
    model.save_pretrained(path, safe_serialization=True)
    return path


def make_dataset(path: str, rows: int, seed: int = 0) -> str:
    """verl's RL parquet format: data_source, prompt (chat messages), ability, reward_model
    (style, ground_truth), extra_info."""
    import random

    import pandas as pd

    rng = random.Random(seed)
    records = []
    for i in range(rows):
        text = "".join(rng.choice("abcdefgh0123456789") for _ in range(8))
        records.append({"data_source": "weightsync/sevens", "prompt": [{"role": "user", "content": text}],
                        "ability": "sevens", "reward_model": {"style": "rule", "ground_truth": TARGET},
                        "extra_info": {"index": i, "split": os.path.basename(path)}})
    pd.DataFrame(records).to_parquet(path)
    return path


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    """Rule reward: the share of the response's characters that are lowercase letters (the
    ground truth lists them); frequent enough for a random policy that GRPO groups differ and
    every step changes the weights."""
    return sum(c in ground_truth for c in solution_str) / len(solution_str) if solution_str else 0.0
