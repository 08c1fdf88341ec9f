"""The engine's paged KV cache: attention must see what transformers' DynamicCache gives it, whichever blocks
of the pool a row's tokens sit in, as rows leave the batch and the pool's storage grows."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import DynamicCache

from retrain.inference.config import KV_BLOCK_TOKENS
from retrain.inference.sampler.decode import Forward, RunningTensors
from retrain.inference.sampler.kv_pool import GROWTH_MIN_BLOCKS, KvPool, KvShape
from retrain.inference.sampler.paged_cache import PagedCache
from retrain.inference.sampler.scheduler import Scheduler
from retrain.model.cache_argument import with_cache
from retrain.model.logprobs import completion_logprobs, left_pad
from retrain.types import SamplingParams
from tests.backend.tiny_model import PROMPTS, encode, make_backend, make_engine, tokenizer_of

LEAVE_AT, KEEP = 2, torch.tensor([0, 2])  # rows 1 and 3 leave the batch after this step (as finished rows do)


def dynamic_cache_logits(model, prompts: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Prefill, then greedy decode steps on transformers' DynamicCache."""
    cache = DynamicCache(config=model.config)
    logits = [model(input_ids=prompts, **with_cache(model, cache), use_cache=True).logits[:, -1]]
    attention, position = torch.ones_like(prompts), prompts.shape[1]
    for step in range(steps):
        token = logits[-1].argmax(dim=-1, keepdim=True)
        if step == LEAVE_AT:
            cache.batch_select_indices(KEEP)
            token, attention = token[KEEP], attention[KEEP]
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


def paged_cache_logits(model, prompts: torch.Tensor, steps: int) -> tuple[list[torch.Tensor], KvPool]:
    """The same steps through the engine's scheduler and paged cache, on a pool whose free blocks are shuffled."""
    pool = KvPool(KvShape.of(model.config, model.dtype), torch.device("cpu"), max_blocks=64)
    pool.release(pool.take(5))
    order = torch.randperm(len(pool.free), generator=torch.Generator().manual_seed(0)).tolist()
    pool.free = [pool.free[i] for i in order]
    rows = prompts.shape[0]
    scheduler = Scheduler(pool, [prompts.shape[1]] * rows, 1, steps + 1, False, torch.device("cpu"))
    forward = Forward(model, PagedCache(pool, None), scheduler, pad_id=0)
    running = scheduler.admit().prefilled
    logits = [torch.stack(forward.prefill(running, list(prompts)))]
    for step in range(steps):
        token = logits[-1].argmax(dim=-1)
        if step == LEAVE_AT:
            for row in (running[1], running[3]):
                scheduler.finish(row)
            running, token = [running[0], running[2]], token[KEEP]
        for row in running:
            row.generated += 1
        running = scheduler.make_room(running)
        logits.append(forward.decode(running, token, RunningTensors.of_rows(running, torch.device("cpu"))))
    return logits, pool


def test_the_paged_cache_gives_the_logits_of_a_dynamic_cache(tiny_spec) -> None:
    model = make_backend(tiny_spec).model.eval()
    prompts = torch.randint(3, 200, (4, KV_BLOCK_TOKENS - 1), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        expected = dynamic_cache_logits(model, prompts, steps=6)
        got, pool = paged_cache_logits(model, prompts, steps=6)
    for want, have in zip(expected, got, strict=True):
        torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-5)
    assert pool.in_use == 2 * 2  # the two rows going on hold two blocks each; the others returned theirs


def test_the_pool_keeps_its_blocks_when_its_storage_grows_and_never_beyond_its_budget() -> None:
    shape = KvShape(layers=2, kv_heads=1, head_dim=2, dtype=torch.float32)
    pool = KvPool(shape, torch.device("cpu"), max_blocks=GROWTH_MIN_BLOCKS + 3)
    first = pool.take(GROWTH_MIN_BLOCKS)
    for layer, storage in enumerate(pool.keys):
        storage.copy_(torch.arange(storage.numel(), dtype=torch.float32).view_as(storage) + layer)
    kept = [storage.clone() for storage in pool.keys]
    pool.take(2)  # grows: the budget caps it below GROWTH times the capacity
    assert pool.capacity == pool.max_blocks and pool.available() == 1
    assert all(torch.equal(storage[: len(old)], old) for storage, old in zip(pool.keys, kept, strict=True))
    pool.release(first[:1])
    assert pool.take(1) == first[:1] and pool.peak_in_use == GROWTH_MIN_BLOCKS + 2
    with pytest.raises(RuntimeError, match="1 blocks left"):
        pool.take(2)


def test_a_reserved_pool_holds_its_budget_from_the_start_and_never_reallocates() -> None:
    """A GPU's pool: one allocation of the budget per call, the same storage whatever is taken and released."""
    shape = KvShape(layers=2, kv_heads=1, head_dim=2, dtype=torch.float32)
    pool = KvPool(shape, torch.device("cpu"), max_blocks=GROWTH_MIN_BLOCKS * 3, reserve=True)
    assert pool.capacity == pool.peak_capacity == pool.max_blocks and pool.in_use == 0
    storages = [storage.data_ptr() for storage in (*pool.keys, *pool.values)]
    assert all(storage.shape[0] == pool.max_blocks * KV_BLOCK_TOKENS for storage in pool.keys)
    taken = pool.take(pool.max_blocks)
    pool.release(taken[:GROWTH_MIN_BLOCKS])
    pool.take(GROWTH_MIN_BLOCKS)
    assert [storage.data_ptr() for storage in (*pool.keys, *pool.values)] == storages
    assert pool.peak_in_use == pool.max_blocks and pool.available() == 0


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
