"""The engine's decode cache writes each step into spare room instead of re-concatenating the whole cache;
attention must see exactly what transformers' DynamicCache gives it (the sampled log-probs are bit-identical)."""

from __future__ import annotations

import warnings

import torch
from transformers import DynamicCache

from retrain.inference.pytorch import GrowingLayer, decode_cache
from retrain.model.cache_argument import with_cache
from retrain.model.logprobs import completion_logprobs, left_pad
from retrain.types import SamplingParams
from tests.backend.tiny_model import PROMPTS, encode, make_backend, make_engine, tokenizer_of


def decode_logits(model, cache: DynamicCache, prompts: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Prefill, then greedy decode steps; rows 1 and 3 leave the batch after step 2 (as finished rows do)."""
    logits = [model(input_ids=prompts, **with_cache(model, cache), use_cache=True).logits[:, -1]]
    attention, position = torch.ones_like(prompts), prompts.shape[1]
    for step in range(steps):
        token = logits[-1].argmax(dim=-1, keepdim=True)
        if step == 2:
            keep = torch.tensor([0, 2])
            cache.batch_select_indices(keep)
            token, attention = token[keep], attention[keep]
        attention = torch.cat([attention, attention.new_ones((attention.shape[0], 1))], dim=1)
        output = model(
            input_ids=token,
            attention_mask=attention,
            position_ids=torch.full_like(token, position),
            **with_cache(model, cache),
            use_cache=True,
        )
        logits.append(output.logits[:, -1])
        position += 1
    return logits


def test_growing_cache_gives_bit_identical_logits(tiny_spec) -> None:
    model = make_backend(tiny_spec).model.eval()
    prompts = torch.randint(3, 200, (4, 9), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        expected = decode_logits(model, DynamicCache(config=model.config), prompts, steps=6)
        # room 2: the buffers fill up and move to new ones mid-decode, and again after the row selection
        cache = decode_cache(model.config, room=2)
        got = decode_logits(model, cache, prompts, steps=6)
    assert all(isinstance(layer, GrowingLayer) for layer in cache.layers)
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
    assert cache.get_seq_length() == 9 + 6


def test_the_cache_reaches_the_model_under_the_name_its_transformers_takes(tiny_spec) -> None:
    """transformers 5.24 renamed the forward's `past_key_values` to `cache`; the old name warns on every call
    (and goes in 5.40). The engine's decode loop and the trainer's shared-prompt forward pass neither warning."""
    backend = make_backend(tiny_spec)
    prompt_ids = encode(backend, PROMPTS[:2])
    prompts, prompt_mask = left_pad(prompt_ids, tokenizer_of(tiny_spec.name_or_path).pad_token_id, backend.device)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        rollouts = make_engine(backend).generate(prompt_ids, 2, SamplingParams(max_tokens=4), generator_seed=0)
        completion_logprobs(
            backend.model,
            prompts,
            prompt_mask,
            torch.tensor([0, 0, 1, 1]),
            rollouts.completion_ids,
            rollouts.completion_mask,
            1.0,
        )
