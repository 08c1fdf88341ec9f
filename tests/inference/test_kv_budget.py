"""inference=pytorch under a KV budget: rows wait or are preempted when the pool is full, the pool follows the
live tokens, and none of it changes what is sampled (uniforms of (seed, row, position))."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import retrain.inference.sampler.decode as decode_module
from retrain.errors import ConfigError
from retrain.inference.config import KV_BLOCK_TOKENS, PytorchEngineConfig
from retrain.inference.pytorch import PytorchEngine
from retrain.inference.sampler.kv_budget import GIB, free_bytes, kv_budget, size_class
from retrain.model.spec import ModelSpec
from retrain.types import Rollouts, SamplingParams
from tests.backend.tiny_model import PROMPTS, encode, make_backend, make_engine, tokenizer_of

# hot enough that rows run long (many blocks each) and stop at different lengths
SAMPLING = SamplingParams(max_tokens=40, temperature=2.5, top_p=0.95, return_entropies=True)
GROUP = 4


@pytest.fixture(scope="module")
def backend():
    return make_backend(ModelSpec(name_or_path="retrain:tiny_qwen3", lora_rank=4))


@pytest.fixture(scope="module")
def prompt_ids(backend):
    return encode(backend, PROMPTS)


def engine_of(backend) -> PytorchEngine:
    return make_engine(backend)


def budget_gb(engine: PytorchEngine, blocks: int) -> float:
    return blocks * engine.kv_shape.block_bytes / GIB


def blocks_for(tokens: int, block_tokens: int = KV_BLOCK_TOKENS) -> int:
    return -(-tokens // block_tokens)


def one_row_blocks(prompt_ids: list[list[int]], block_tokens: int = KV_BLOCK_TOKENS) -> int:
    """The smallest budget the engine takes: one row at its longest, and a copy of a shared prompt block."""
    return blocks_for(max(map(len, prompt_ids)) + SAMPLING.max_tokens, block_tokens) + 1


def assert_same_rollouts(got: Rollouts, expected: Rollouts) -> None:
    assert torch.equal(got.completion_ids, expected.completion_ids)
    assert torch.equal(got.completion_mask, expected.completion_mask)
    assert torch.equal(got.hit_max_tokens, expected.hit_max_tokens)
    torch.testing.assert_close(got.logprobs, expected.logprobs, rtol=1e-5, atol=5e-5)
    torch.testing.assert_close(got.entropies, expected.entropies, rtol=1e-5, atol=5e-5)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_budgets_from_all_rows_to_one_row_at_a_time_sample_the_same(backend, prompt_ids, prefix_caching):
    all_at_once = make_engine(backend, prefix_caching=prefix_caching).generate(prompt_ids, GROUP, SAMPLING, 5)
    assert all_at_once.metrics["engine/rows_waiting_max"] == 0
    smallest = one_row_blocks(prompt_ids)
    for blocks in (smallest, smallest + 2, 14, 30):
        engine = make_engine(backend, prefix_caching=prefix_caching, kv_cache_gb=budget_gb(engine_of(backend), blocks))
        rollouts = engine.generate(prompt_ids, GROUP, SAMPLING, 5)
        assert_same_rollouts(rollouts, all_at_once)
        assert rollouts.metrics["engine/kv_reserved_gb"] <= budget_gb(engine, blocks)
        if blocks == smallest:
            assert rollouts.metrics["engine/rows_waiting_max"] >= GROUP * len(prompt_ids) - GROUP
            if prefix_caching:  # the group's rows share the prompt's blocks, so more enter than can grow
                assert rollouts.metrics["engine/preemptions"] > 0
            else:
                assert rollouts.metrics["engine/rows_waiting_max"] == GROUP * len(prompt_ids) - 1


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_larger_blocks_sample_the_same_all_at_once_and_one_row_at_a_time(backend, prompt_ids, prefix_caching):
    """inference.kv_block_tokens changes where tokens sit and how many rows a budget holds, never what is sampled."""
    expected = make_engine(backend, prefix_caching=prefix_caching).generate(prompt_ids, GROUP, SAMPLING, 5)
    wide = make_engine(backend, prefix_caching=prefix_caching, kv_block_tokens=64)
    assert (
        wide.kv_shape.block_tokens == 64 and wide.kv_shape.block_bytes == 4 * make_engine(backend).kv_shape.block_bytes
    )
    assert_same_rollouts(wide.generate(prompt_ids, GROUP, SAMPLING, 5), expected)
    smallest = one_row_blocks(prompt_ids, 64)
    squeezed = make_engine(
        backend, prefix_caching=prefix_caching, kv_block_tokens=64, kv_cache_gb=budget_gb(wide, smallest)
    )
    rollouts = squeezed.generate(prompt_ids, GROUP, SAMPLING, 5)
    assert_same_rollouts(rollouts, expected)
    assert rollouts.metrics["engine/rows_waiting_max"] > 0  # one row's 64-token blocks at a time: the others wait


def test_the_block_size_is_checked_at_compose_time() -> None:
    for wrong in (8, 24, 0):
        with pytest.raises(ConfigError, match=f"inference.kv_block_tokens must be a power of two >= 16, got {wrong}"):
            PytorchEngineConfig(kv_block_tokens=wrong)


def test_prefix_caching_and_the_budget_together_sample_what_plain_batching_does(backend, prompt_ids):
    plain = make_engine(backend, prefix_caching=False).generate(prompt_ids, GROUP, SAMPLING, 8)
    squeezed = make_engine(backend, kv_cache_gb=budget_gb(engine_of(backend), one_row_blocks(prompt_ids) + 1))
    assert_same_rollouts(squeezed.generate(prompt_ids, GROUP, SAMPLING, 8), plain)


def test_the_peak_follows_the_live_tokens(backend, prompt_ids):
    """Without prefix caching every row holds its own blocks: at each step, those of the rows still going (the stop
    flags read at every step: a longer window holds a stopped row's blocks until it ends)."""
    engine = make_engine(backend, prefix_caching=False, stop_check_steps=1)
    rollouts = engine.generate(prompt_ids, GROUP, SAMPLING, 5)
    prompts = [len(prompt_ids[row // GROUP]) for row in range(rollouts.num_rows)]
    lengths = rollouts.completion_mask.sum(dim=1).tolist()
    # after drawing token t, a row that goes on stores prompt + t + 1 tokens (the prompt alone before any draw)
    held = [sum(blocks_for(p) for p in prompts)] + [
        sum(blocks_for(p + t + 1) for p, n in zip(prompts, lengths, strict=True) if n > t + 1)
        for t in range(SAMPLING.max_tokens)
    ]
    block_bytes = engine.kv_shape.block_bytes
    assert rollouts.metrics["engine/kv_peak_gb"] * GIB == max(held) * block_bytes
    at_full_length = sum(blocks_for(p + SAMPLING.max_tokens - 1) for p in prompts)
    assert min(lengths) < SAMPLING.max_tokens and max(held) < at_full_length  # rows that stop early free theirs


def test_a_long_prompt_batch_prefills_in_pieces(backend, prompt_ids, monkeypatch):
    whole = make_engine(backend).generate(prompt_ids, GROUP, SAMPLING, 3)
    monkeypatch.setattr(decode_module, "PREFILL_TOKENS", 20)  # shorter than any prompt: pieces with a cached past
    assert_same_rollouts(make_engine(backend).generate(prompt_ids, GROUP, SAMPLING, 3), whole)


def test_a_budget_that_cannot_hold_one_row_names_the_key(backend, prompt_ids):
    engine = make_engine(backend, kv_cache_gb=budget_gb(engine_of(backend), one_row_blocks(prompt_ids) - 1))
    with pytest.raises(ConfigError, match="inference.kv_cache_gb"):
        engine.generate(prompt_ids, GROUP, SAMPLING, 0)


def test_the_memory_plans_budget_applies_when_the_key_is_automatic(backend, prompt_ids):
    block_bytes = engine_of(backend).kv_shape.block_bytes
    for blocks, fits in ((one_row_blocks(prompt_ids), True), (one_row_blocks(prompt_ids) - 1, False)):
        resources = dataclasses.replace(backend.engine_resources(), kv_cache_bytes=blocks * block_bytes)
        engine = PytorchEngine(PytorchEngineConfig(), tokenizer_of(backend.spec.name_or_path), resources)
        if fits:
            assert engine.generate(prompt_ids, GROUP, SAMPLING, 0).metrics["engine/rows_waiting_max"] > 0
        else:
            with pytest.raises(ConfigError, match="memory plan.*inference.kv_cache_gb"):
                engine.generate(prompt_ids, GROUP, SAMPLING, 0)


def test_without_a_budget_the_engine_takes_the_free_memory_less_a_margin():
    cpu = torch.device("cpu")
    budget = kv_budget(0.0, None, cpu)
    assert 0 < budget.bytes < free_bytes(cpu) and "inference.kv_cache_gb=0" in budget.source
    assert kv_budget(1.5, 123, cpu).bytes == int(1.5 * GIB)  # the key wins over the plan
    assert kv_budget(0.0, 123, cpu).bytes == 123
    assert size_class(budget.bytes) == budget.bytes


def test_an_automatic_budget_is_one_of_eight_sizes_per_doubling():
    """The free memory moves between calls; the pool's size (the flex kernel's shape) should not with it."""
    sizes = range(40 * GIB, 80 * GIB, 2**24)
    classes = {size_class(size) for size in sizes}
    assert len(classes) == 8
    assert all(0.875 * size < size_class(size) <= size for size in sizes)


def test_no_seed_draws_one_from_torchs_generator(backend, prompt_ids):
    engine = make_engine(backend)
    torch.manual_seed(21)
    first = engine.generate(prompt_ids, GROUP, SAMPLING, None)
    torch.manual_seed(21)
    assert_same_rollouts(engine.generate(prompt_ids, GROUP, SAMPLING, None), first)


def test_the_quickstarts_smallest_budget_holds_its_real_rows(backend):
    """`experiment=quickstart inference.kv_cache_gb=0.0002`: the memory plan, which assumes prompts of the context less
    max_tokens (128 tokens a row), leaves this budget to the sampler (tests/test_memory_plan.py); the sampler, which
    knows the prompts (~40 tokens), samples them in it."""
    from retrain.config import compose
    from retrain.run import build_part

    cfg = compose(["experiment=quickstart", "inference.kv_cache_gb=0.0002"])
    examples = build_part(cfg, "data", seed=0).train_examples[: cfg.training.batch_size]
    prompt_ids = encode(backend, [example.prompt for example in examples])
    engine = make_engine(backend, kv_cache_gb=cfg.inference.kv_cache_gb)
    sampling = SamplingParams(max_tokens=cfg.training.max_tokens, temperature=1.0, top_p=1.0)
    rollouts = engine.generate(prompt_ids, cfg.training.group_size, sampling, 0)
    assert rollouts.completion_ids.shape[0] == len(examples) * cfg.training.group_size
    assert max(map(len, prompt_ids)) + cfg.training.max_tokens < 128  # what the plan assumed a row to be


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_reading_the_stop_flags_once_a_window_samples_what_reading_them_every_step_does(
    backend, prompt_ids, prefix_caching
):
    """Rows that stopped draw on until their window ends (a GPU's host reads the flags once per window), under
    budgets that queue and preempt rows: none of it reaches the rollouts."""
    every_step = make_engine(backend, prefix_caching=prefix_caching, stop_check_steps=1)
    expected = every_step.generate(prompt_ids, GROUP, SAMPLING, 6)
    assert len(set(expected.completion_mask.sum(dim=1).tolist())) > 3  # rows stop apart, inside windows
    smallest = one_row_blocks(prompt_ids)
    for steps, blocks in ((5, 30), (8, smallest), (16, smallest + 2), (16, 30)):
        engine = make_engine(
            backend,
            prefix_caching=prefix_caching,
            stop_check_steps=steps,
            kv_cache_gb=budget_gb(every_step, blocks),
        )
        rollouts = engine.generate(prompt_ids, GROUP, SAMPLING, 6)
        assert_same_rollouts(rollouts, expected)
        assert rollouts.metrics["engine/kv_reserved_gb"] <= budget_gb(engine, blocks)
        if blocks == smallest and prefix_caching:
            assert rollouts.metrics["engine/preemptions"] > 0
