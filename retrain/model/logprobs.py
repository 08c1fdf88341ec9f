"""Token log-probabilities of a causal LM, computed the same way by the sampler and the trainer.

Prompts are left-padded and completions right-padded; position ids are derived from the attention
mask, so padding never changes a real token's logits. Log-probs are taken from the
temperature-scaled distribution log_softmax(logits / T): the sampler records them while sampling,
the trainer recomputes them here, and on fresh samples the two agree (importance ratio 1).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from retrain.model.lean_decoder import causal_lm_logits
from retrain.model.packing import packed_logits
from retrain.model.rows import positions_from_mask, rows_of

# The LM head runs over chunks of tokens whose fp32 logits take at most this much (a [tokens, vocabulary]
# fp32 tensor is never built whole): 256 MiB is ~440 tokens of Qwen3's 151,936-entry vocabulary.
LOGITS_CHUNK_BYTES = 256 * 2**20


def left_pad(sequences: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists → ([B, P] ids, [B, P] bool mask), padded on the left."""
    if not sequences:
        raise ValueError("no prompts to pad")
    empty = [i for i, seq in enumerate(sequences) if not seq]
    if empty:
        raise ValueError(f"prompts at positions {empty} have no tokens")
    width = max(len(seq) for seq in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.bool)
    for row, seq in enumerate(sequences):
        ids[row, width - len(seq) :] = torch.tensor(seq, dtype=torch.long)
        mask[row, width - len(seq) :] = True
    return ids.to(device), mask.to(device)


def scaled_log_softmax(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) in fp32; T = 0 (greedy) uses T = 1, the model's own distribution."""
    scale = temperature if temperature > 0 else 1.0
    return torch.log_softmax(logits.float() / scale, dim=-1)


def completion_logprobs(
    model: Any,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    prompt_index: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    temperature: float,
    share_prompts: bool = True,
) -> torch.Tensor:
    """[R, T] log-prob of each completion token given its prompt and the completion tokens before it
    (0 on padding); differentiable when grad is enabled.

    Row r continues prompt `prompt_index[r]` of the [B, P] prompts. With `share_prompts`, each prompt
    runs once: packed with its rows' completions into one row (retrain/model/packing.py) where that
    applies, else as a prefill whose KV cache (with its autograd graph) is repeated for its rows, as the
    sampler does; otherwise every row runs prompt + completion in one forward (needed under activation
    checkpointing, which drops KV caches).
    """
    if share_prompts:
        shared = (model, prompt_ids, prompt_mask, prompt_index, completion_ids, completion_mask)
        packed = packed_logits(*shared)
        logits = packed if packed is not None else _logits_with_shared_prompts(*shared)
    else:
        logits = _logits_in_one_forward(
            model, prompt_ids[prompt_index], prompt_mask[prompt_index], completion_ids, completion_mask
        )
    scale = temperature if temperature > 0 else 1.0
    scaled = logits.float() / scale
    chosen = scaled.gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)
    logprobs = chosen - torch.logsumexp(scaled, dim=-1)
    return logprobs.masked_fill(~completion_mask, 0.0)


def _logits_in_one_forward(
    model: Any,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
) -> torch.Tensor:
    """[R, T, V] next-token logits for every completion position, from one forward per row."""
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    width = completion_ids.shape[1]
    logits = causal_lm_logits(
        model, input_ids, attention_mask.long(), positions_from_mask(attention_mask), logits_to_keep=width + 1
    )
    # Logits at position i predict token i + 1: the last width + 1 positions cover every completion
    # token (the first is predicted from the prompt's last token); the very last predicts nothing.
    return logits[:, :-1]


def _logits_with_shared_prompts(
    model: Any,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    prompt_index: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
) -> torch.Tensor:
    """[R, T, V] next-token logits: one prefill per prompt, its cache repeated per row, then one
    forward over every row's completion tokens (but the last, which predicts nothing)."""
    cache = DynamicCache(config=model.config)
    prefill = causal_lm_logits(
        model, prompt_ids, prompt_mask.long(), positions_from_mask(prompt_mask), cache, logits_to_keep=1
    )
    first = rows_of(prefill[:, -1:], prompt_index)  # predicts completion token 0
    width = completion_ids.shape[1]
    if width == 1:
        return first
    select_rows(cache, prompt_index)
    row_prompt_mask = prompt_mask[prompt_index]
    attention_mask = torch.cat([row_prompt_mask, completion_mask[:, :-1]], dim=1)
    positions = row_prompt_mask.sum(dim=1, keepdim=True) + torch.arange(width - 1, device=completion_ids.device)
    rest = causal_lm_logits(model, completion_ids[:, :-1], attention_mask.long(), positions, cache)
    return torch.cat([first, rest], dim=1)


def select_rows(cache: DynamicCache, rows: torch.Tensor) -> None:
    """cache.batch_select_indices(rows); on CPU through `rows_of` for plain layers."""
    plain = [layer for layer in cache.layers if type(layer) is DynamicLayer]
    if rows.device.type != "cpu" or len(plain) < len(cache.layers):  # other layer kinds keep their own
        cache.batch_select_indices(rows)
        return
    for layer in plain:
        if layer.keys is not None and layer.values is not None:
            layer.keys, layer.values = rows_of(layer.keys, rows), rows_of(layer.values, rows)
