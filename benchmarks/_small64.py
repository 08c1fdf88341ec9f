"""The `small64` workload of benchmarks/vs_trl.py: a random-init ~25M-parameter Qwen3 and a reward
that varies on its output.

A random model almost never writes a boxed answer, so exact match would score every completion 0,
every group would be uniform and retrain would skip training altogether. `vowel_share` gives every
completion a different score, so every group carries signal and both trainers train on all rows.
Reward workers import this module by name (`reward._target_=_small64.vowel_share` with benchmarks/
on PYTHONPATH), so it imports nothing heavy at the top.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

HIDDEN, LAYERS, HEADS, KV_HEADS, INTERMEDIATE = 512, 8, 8, 4, 1536
MAX_POSITIONS = 1024  # the longest chat-templated GSM8K question of small64_gsm8k (634 byte tokens) + 64 new tokens
VOWELS = frozenset("aeiouAEIOU")


def write_model(directory: Path, seed: int = 0) -> Path:
    """Save the random-init Qwen3 (weights drawn from `seed`) with the bundled tiny model's byte tokenizer."""
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(str(resources.files("retrain.assets").joinpath("tiny_qwen3")))
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HIDDEN // HEADS,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def vowel_share(response: str, reference: str, **extra: Any) -> float:
    """Share of the completion's characters that are ASCII vowels (0 for an empty completion)."""
    return sum(char in VOWELS for char in response) / len(response) if response else 0.0
