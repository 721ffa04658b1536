"""What a user brings to a verl run, made locally (no hub access in CI): a tiny Qwen2 in fp32
with a word-level tokenizer and a chat template, a small prompt dataset in verl's parquet
format, and a rule reward (``compute_score``, the name verl's ``custom_reward_function``
looks up)."""

from __future__ import annotations

import os

WORDS = [f"w{i}" for i in range(240)]
SPECIAL = ["<pad>", "<eos>", "<|user|>", "<|assistant|>", "<unk>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
TARGET = "w7"  # the word the reward asks for


def make_model(path: str, seed: int = 0) -> str:
    """A 2-layer Qwen2 (hidden 64, vocab 256, untied embeddings) in fp32 and its tokenizer."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    os.makedirs(path, exist_ok=True)
    vocab = {w: i for i, w in enumerate(SPECIAL + WORDS)}
    raw = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
                                  additional_special_tokens=["<|user|>", "<|assistant|>"])
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)
    config = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False, torch_dtype="float32", bos_token_id=None,
                         eos_token_id=vocab["<eos>"], pad_token_id=vocab["<pad>"])
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.float32)
    model.generation_config.eos_token_id = vocab["<eos>"]
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
        words = " ".join(rng.choice(WORDS) for _ in range(6))
        records.append({"data_source": "weightsync/echo", "prompt": [{"role": "user", "content": words}],
                        "ability": "echo", "reward_model": {"style": "rule", "ground_truth": TARGET},
                        "extra_info": {"index": i, "split": os.path.basename(path)}})
    pd.DataFrame(records).to_parquet(path)
    return path


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    """Rule reward: the share of the response's words that are the target word."""
    words = solution_str.split()
    return sum(w == ground_truth for w in words) / len(words) if words else 0.0
