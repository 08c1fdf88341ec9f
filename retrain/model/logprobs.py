"""Token log-probabilities of a causal LM, computed the same way by the sampler and the trainer.

Prompts are left-padded and completions right-padded; position ids are derived from the attention
mask, so padding never changes a real token's logits. Log-probs are taken from the
temperature-scaled distribution log_softmax(logits / T): the sampler records them while sampling,
the trainer recomputes them here, and on fresh samples the two agree (importance ratio 1).

The trainer's logits are never built whole: at Qwen3's 151,936-entry vocabulary a [tokens, vocabulary]
fp32 tensor takes 0.6 MB a token, 12 GB for two rows of 10,240 tokens. The decoder's forward stops at its
last hidden states, and the LM head, the temperature, the logsumexp and the chosen token's logit run on
the real completion tokens only, in chunks whose fp32 logits take at most LOGITS_CHUNK_BYTES; under
autograd each chunk is checkpointed (its logits recomputed in backward), so backward holds one chunk's
logits at a time too. Everything in one chunk (a small model's step) runs as one plain head call.
Checkpointing rather than a hand-written backward: it works for whatever module the head is (a plain
linear, one tied to the embeddings, a LoRA-adapted one, one behind accelerate's hooks) and gives autograd's
own gradient of the same ops; its price is autograd's intermediates within a chunk. A model whose logits
are more than its output embeddings applied to those hidden states (Gemma 2's final-logit softcap,
Cohere's and Granite's logit scales; anything not in PLAIN_HEAD) takes the full logits instead. The entropy of
each token's distribution (training.entropy_coef) is computed inside the same chunks, never from whole logits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from retrain.model.document_packing import document_hidden
from retrain.model.lean_decoder import causal_lm_hidden, causal_lm_logits, causal_lm_of, keeps_caches
from retrain.model.packing import packed_hidden
from retrain.model.rows import positions_from_mask, rows_of

# The LM head runs over chunks of tokens whose fp32 logits take at most this much (a [tokens, vocabulary]
# fp32 tensor is never built whole): 256 MiB is ~440 tokens of Qwen3's 151,936-entry vocabulary.
LOGITS_CHUNK_BYTES = 256 * 2**20
# model_type -> transformers' *ForCausalLM computes its logits as lm_head(last hidden state), nothing more
PLAIN_HEAD = frozenset(
    {"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "phi3", "gemma", "olmo2", "smollm3"}
)

# features of a forward: the decoder's hidden states, or a model's full logits (causal_lm_hidden's arguments)
Forward = Callable[..., torch.Tensor]


@dataclass
class ForwardTokens:
    """Token positions the training forwards computed, and how many of them held a real token (the rest: padding,
    `train/padding_frac`); a prompt shared by its rows counts once where its forward runs it once."""

    computed: int = 0
    real: torch.Tensor | int = 0  # a count on the forwards' device: read once a step, not once a forward

    def add(self, computed: int, real: torch.Tensor) -> None:
        self.computed += computed
        self.real = self.real + real


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
    """log_softmax(logits / T) in fp32; T = 0 (greedy) uses T = 1, the model's own distribution (no division: an
    op per decode step that would change nothing)."""
    logits = logits.float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1)


def completion_logprobs(
    model: Any,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    prompt_index: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    temperature: float,
    share_prompts: bool = True,
    documents: bool = False,
    tokens: ForwardTokens | None = None,
) -> torch.Tensor:
    """[R, T] fp32 log-prob of each completion token given its prompt and the completion tokens before it
    (0 on padding); differentiable when grad is enabled.

    Row r continues prompt `prompt_index[r]` of the [B, P] prompts. With `share_prompts`, each prompt
    runs once: packed with its rows' completions into one row (retrain/model/packing.py) where that
    applies, else as a prefill whose KV cache (with its autograd graph) is repeated for its rows, as the
    sampler does, where the forward keeps caches (not under activation checkpointing: `keeps_caches`);
    otherwise every row runs prompt + completion in one forward. With `documents`, all rows run as one sequence of
    documents through flex_attention instead (retrain/model/document_packing.py; the lean forward's, on a GPU). The
    head runs as the module docstring says. `tokens`: where given, counts the positions the forwards computed.
    """
    head, features, targets = _real_token_features(
        model, prompt_ids, prompt_mask, prompt_index, completion_ids, completion_mask, share_prompts, documents, tokens
    )
    return _scattered(completion_mask, head_logprobs(head, features, targets, temperature))


def completion_logprobs_and_entropy(
    model: Any,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    prompt_index: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    temperature: float,
    share_prompts: bool = True,
    documents: bool = False,
    tokens: ForwardTokens | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`completion_logprobs` and, [R, T] too, the entropy of each token's whole tempered distribution (0 on
    padding), computed inside the same chunks of logits (training.entropy_coef)."""
    head, features, targets = _real_token_features(
        model, prompt_ids, prompt_mask, prompt_index, completion_ids, completion_mask, share_prompts, documents, tokens
    )
    both = _over_chunks(_chunk_logprobs_and_entropy, head, features, targets, temperature)
    return _scattered(completion_mask, both[:, 0]), _scattered(completion_mask, both[:, 1])


def _real_token_features(
    model: Any,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    prompt_index: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    share_prompts: bool,
    documents: bool,
    tokens: ForwardTokens | None,
) -> tuple[torch.nn.Module | None, torch.Tensor, torch.Tensor]:
    """The head, the [N, F] features that predict the N real completion tokens, and those tokens."""
    head = output_head(model)
    forward: Forward = causal_lm_logits if head is None else causal_lm_hidden
    shared = (model, prompt_ids, prompt_mask, prompt_index, completion_ids, completion_mask)
    groups, prompt_width = prompt_ids.shape
    rows, width = completion_ids.shape
    once = True  # each prompt runs once
    if documents:  # a mirrored model (backend.train_attention): its head is plain, `features` hidden states
        features, packing = document_hidden(*shared)
        computed = packing.tokens
    elif share_prompts and head is not None and (packed := packed_hidden(*shared)) is not None:
        features, layout = packed
        computed = groups * layout.length
    elif share_prompts and keeps_caches(model):
        features = _features_with_shared_prompts(forward, *shared)
        computed = groups * prompt_width + rows * (width - 1)
    else:
        features = _features_in_one_forward(
            forward, model, prompt_ids[prompt_index], prompt_mask[prompt_index], completion_ids, completion_mask
        )
        computed, once = rows * (prompt_width + width), False
    if tokens is not None:  # the real tokens among them: each prompt once where it runs once
        prompts, inputs = (
            (prompt_mask, completion_mask[:, :-1]) if once else (prompt_mask[prompt_index], completion_mask)
        )
        tokens.add(computed, prompts.sum() + inputs.sum())
    real = completion_mask.flatten().nonzero().squeeze(1)
    return head, rows_of(features.flatten(0, 1), real), completion_ids.flatten()[real]


def _scattered(completion_mask: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """[R, T] with the real tokens' `values` in place, 0 on padding."""
    return torch.zeros(completion_mask.shape, dtype=values.dtype, device=values.device).masked_scatter(
        completion_mask, values
    )


def output_head(model: Any) -> torch.nn.Module | None:
    """The module that turns `causal_lm_hidden`'s hidden states into `model`'s logits (its output embeddings), or
    None where its logits are more than that (a softcap, a scale: see PLAIN_HEAD)."""
    causal_lm = causal_lm_of(model)
    if causal_lm.config.model_type not in PLAIN_HEAD:
        return None
    return causal_lm.get_output_embeddings()


def head_logprobs(
    head: torch.nn.Module | None, features: torch.Tensor, targets: torch.Tensor, temperature: float
) -> torch.Tensor:
    """[N] fp32 log_softmax(head(features) / T)[target] for [N, hidden] features (with head None: [N, V] logits),
    over chunks of tokens whose fp32 logits take at most LOGITS_CHUNK_BYTES; under autograd a chunk's logits are
    recomputed in its backward rather than kept. One chunk runs plainly."""
    return _over_chunks(_chunk_logprobs, head, features, targets, temperature)


def _over_chunks(
    per_chunk_values: Callable[..., torch.Tensor],
    head: torch.nn.Module | None,
    features: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
) -> torch.Tensor:
    """`per_chunk_values(head, chunk, targets, scale)` over the chunks of `head_logprobs`, concatenated."""
    scale = temperature if temperature > 0 else 1.0
    vocabulary = features.shape[-1] if head is None else _vocabulary(head)
    per_chunk = max(1, LOGITS_CHUNK_BYTES // (4 * vocabulary))
    if len(features) <= per_chunk:
        return per_chunk_values(head, features, targets, scale)
    differentiable = torch.is_grad_enabled() and (
        features.requires_grad or (head is not None and any(p.requires_grad for p in head.parameters()))
    )
    chunks = []
    for chunk, chosen in zip(features.split(per_chunk), targets.split(per_chunk), strict=True):
        if differentiable:
            chunks.append(checkpoint(per_chunk_values, head, chunk, chosen, scale, use_reentrant=False))
        else:
            chunks.append(per_chunk_values(head, chunk, chosen, scale))
    return torch.cat(chunks)


def _chunk_logprobs(
    head: torch.nn.Module | None, features: torch.Tensor, targets: torch.Tensor, scale: float
) -> torch.Tensor:
    """One chunk of `head_logprobs`."""
    logits = features if head is None else head(features)
    scaled = logits.float() / scale
    chosen = scaled.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return chosen - torch.logsumexp(scaled, dim=-1)


def _chunk_logprobs_and_entropy(
    head: torch.nn.Module | None, features: torch.Tensor, targets: torch.Tensor, scale: float
) -> torch.Tensor:
    """[N, 2]: one chunk's log-probs (as `_chunk_logprobs`) and entropies −Σ p·log p of the tempered distribution."""
    logits = features if head is None else head(features)
    scaled = logits.float() / scale
    log_norm = torch.logsumexp(scaled, dim=-1)
    chosen = scaled.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - log_norm
    entropy = log_norm - (torch.softmax(scaled, dim=-1) * scaled).sum(dim=-1)
    return torch.stack([chosen, entropy], dim=-1)


def _vocabulary(head: torch.nn.Module) -> int:
    """Logits per token of an output embedding (a linear layer, perhaps wrapped by PEFT)."""
    weight = head.weight
    assert isinstance(weight, torch.Tensor)
    return weight.shape[0]


def _features_in_one_forward(
    forward: Forward,
    model: Any,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
) -> torch.Tensor:
    """[R, T, F] features (hidden states or logits, as `forward` gives) for every completion position, from
    one forward per row."""
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    width = completion_ids.shape[1]
    features = forward(model, input_ids, attention_mask.long(), positions_from_mask(attention_mask), None, width + 1)
    # Position i predicts token i + 1: the last width + 1 positions cover every completion token (the first
    # is predicted from the prompt's last token); the very last predicts nothing.
    return features[:, :-1]


def _features_with_shared_prompts(
    forward: Forward,
    model: Any,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    prompt_index: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
) -> torch.Tensor:
    """[R, T, F] features for every completion position: one prefill per prompt, its cache repeated per row,
    then one forward over every row's completion tokens (but the last, which predicts nothing)."""
    cache = DynamicCache(config=model.config)
    prefill = forward(model, prompt_ids, prompt_mask.long(), positions_from_mask(prompt_mask), cache, 1)
    first = rows_of(prefill[:, -1:], prompt_index)  # predicts completion token 0
    width = completion_ids.shape[1]
    if width == 1:
        return first
    select_rows(cache, prompt_index)
    row_prompt_mask = prompt_mask[prompt_index]
    attention_mask = torch.cat([row_prompt_mask, completion_mask[:, :-1]], dim=1)
    positions = row_prompt_mask.sum(dim=1, keepdim=True) + torch.arange(width - 1, device=completion_ids.device)
    rest = forward(model, completion_ids[:, :-1], attention_mask.long(), positions, cache)
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
