"""What a phase could reach at best: decode against memory bandwidth, training as PRIME-RL counts MFU.

Decode is memory-bound: every forward reads all the weights once, and every row's step reads that row's
live KV cache; the bound is those bytes at the device's measured copy bandwidth. Training FLOPs follow
PRIME-RL's PerfCounter (PrimeIntellect-ai/prime-rl, src/prime_rl/trainer/perf.py): with LoRA, a token
costs 4 × the matmul parameters (forward, plus the input gradient through the frozen base), 6 × the
adapter's parameters, and 12 · layers · heads · (hidden / heads) · sequence length for attention, against
the GPU's dense bf16 peak (the datasheet figure, as PRIME-RL takes it from torchtitan).
"""

from __future__ import annotations

import time
from typing import Any

import torch

BANDWIDTH_BUFFER_BYTES = {"cuda": 4 << 30, "cpu": 256 << 20}
BANDWIDTH_COPIES = {"cuda": 10, "cpu": 3}
HOPPER_PEAK_BF16 = {"NVL": 835e12, "PCIe": 756e12}  # by variant; SXM and the rest: 989e12, as perf.py


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of a large device-to-device copy (each byte counted read and written)."""
    size = BANDWIDTH_BUFFER_BYTES[device.type]
    source = torch.empty(size, dtype=torch.uint8, device=device).fill_(1)
    target = torch.empty_like(source)
    target.copy_(source)  # warm-up
    copies = BANDWIDTH_COPIES[device.type]
    _synchronize(device)
    started = time.perf_counter()
    for _ in range(copies):
        target.copy_(source)
    _synchronize(device)
    return 2 * size * copies / (time.perf_counter() - started)


def peak_bf16_flops(device: torch.device) -> float | None:
    """The device's dense bf16 peak as PRIME-RL counts it; None on a CPU or an unknown GPU."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    if "A100" in name:
        return 312e12
    if "H100" in name or "H200" in name:
        return next((flops for variant, flops in HOPPER_PEAK_BF16.items() if variant in name), 989e12)
    return None


def decode_kv_reads(prompt_lengths: torch.Tensor, completion_lengths: torch.Tensor) -> int:
    """Cached positions read over a sampling call: a row's t-th decode forward (t = 1 … c − 1) reads its
    prompt and t generated tokens (the first token comes from the prefill)."""
    steps = (completion_lengths - 1).clamp_min(0)
    return int((steps * prompt_lengths + steps * (steps + 1) // 2).sum())


def matmul_parameters(config: Any) -> int:
    """Parameters a token passes through in matmuls (attention projections, MLP, LM head): perf.py's
    get_active_mm_params for a dense GQA model."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    hidden, layers = config.hidden_size, config.num_hidden_layers
    attention = layers * hidden * head_dim * (2 * config.num_attention_heads + 2 * config.num_key_value_heads)
    mlp = layers * 3 * config.intermediate_size * hidden
    return attention + mlp + config.vocab_size * hidden


def lora_training_flops(config: Any, adapter_parameters: int, sequence_lengths: torch.Tensor) -> float:
    """FLOPs of one LoRA forward + backward over sequences of these lengths, counted as perf.py's
    estimate_batch_flops (attention with hidden // heads per head, as perf.py has it)."""
    per_token = 4 * matmul_parameters(config) + 6 * adapter_parameters
    attention = (
        12 * config.num_hidden_layers * config.num_attention_heads * (config.hidden_size // config.num_attention_heads)
    )
    lengths = sequence_lengths.long()
    return float(per_token * int(lengths.sum()) + attention * int((lengths * lengths).sum()))


def causal_training_flops(
    config: Any, adapter_parameters: int, prompt_lengths: list[int], completion_lengths: list[list[int]]
) -> float:
    """FLOPs a LoRA forward + backward needs at least over groups of rows: prompt p's group shares its
    `prompt_lengths[p]` tokens, then each of its `completion_lengths[p]` follows it. Every token passes the
    decoder's matmuls (perf.py's 4 × matmul parameters, 6 × the adapter's), only completion tokens the LM head
    (their log-probs are what the loss needs), and attention as `causal_attention_flops`."""
    head = config.vocab_size * config.hidden_size
    body = matmul_parameters(config) - head
    completions = sum(sum(group) for group in completion_lengths)
    tokens = sum(prompt_lengths) + completions
    attention = causal_attention_flops(config, prompt_lengths, completion_lengths)
    return float((4 * body + 6 * adapter_parameters) * tokens + 4 * head * completions + attention)


def causal_attention_flops(config: Any, prompt_lengths: list[int], completion_lengths: list[list[int]]) -> float:
    """Attention's share of `causal_training_flops`: each query's causal keys alone, a prompt's pairs once and each
    completion's pairs with its prompt and its own earlier tokens; 2 matmuls forward, 5 backward (flash
    attention's, which recomputes the scores), 2 · head_dim FLOPs each per head and layer."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    pairs = 0
    for prompt, group in zip(prompt_lengths, completion_lengths, strict=True):
        pairs += prompt * (prompt + 1) // 2 + sum(c * prompt + c * (c + 1) // 2 for c in group)
    return float(pairs * 7 * 2 * head_dim * config.num_attention_heads * config.num_hidden_layers)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
