"""Attention straight over the KV pool through the block tables (inference.paged_attention=flex) computes what the
gather path's copy and sdpa compute: per forward (eager and compiled flex_attention, decode steps and queries
after a cached prefix, blocks shared between rows, rows padded to their bucket), and through the engine (same
rollouts to fp32 rounding, under budgets that queue and preempt rows)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._triton import has_triton
from transformers import AutoModelForCausalLM, MistralConfig

from retrain.errors import ConfigError
from retrain.inference.config import KV_BLOCK_TOKENS, PytorchEngineConfig
from retrain.inference.pytorch import reads_the_pool
from retrain.inference.sampler.kv_pool import GROWTH_MIN_BLOCKS, KvPool, KvShape
from retrain.inference.sampler.paged_attention import (
    MIN_ROW_BUCKET,
    block_mask_bytes,
    paged_attention,
    paged_block_mask,
    pool_sequence,
    row_bucket,
)
from retrain.model.spec import ModelSpec
from tests.backend.tiny_model import PROMPTS, encode, make_backend, make_engine
from tests.inference.test_kv_budget import GROUP, SAMPLING, assert_same_rollouts, budget_gb, one_row_blocks

KV_HEADS, HEADS, DIM, POOL_BLOCKS = 2, 4, 16, 24


def a_pool_and_tables(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys, values ([slots, kv_heads, dim]) and block tables of rows holding `lengths` tokens, their blocks
    scattered over the pool, rows 0 and 1 sharing their first block (a group's prompt), tables padded with 0."""
    generator = torch.Generator().manual_seed(0)
    keys, values = torch.randn(2, POOL_BLOCKS * KV_BLOCK_TOKENS, KV_HEADS, DIM, generator=generator)
    free = torch.randperm(POOL_BLOCKS, generator=generator).tolist()
    counts = [-(-length // KV_BLOCK_TOKENS) for length in lengths]
    table = torch.zeros(len(lengths), max(counts) + 2, dtype=torch.long)
    for row, count in enumerate(counts):
        table[row, :count] = torch.tensor([free.pop() for _ in range(count)])
    table[1, 0] = table[0, 0]
    return keys, values, table


def gathered_attention(query, keys, values, table, lengths, width) -> torch.Tensor:
    """The gather path, row by row: the row's live keys copied out of the pool, sdpa with causal new queries."""
    outputs = []
    for row, length in enumerate(lengths):
        index = torch.arange(length)
        slots = table[row, index // KV_BLOCK_TOKENS] * KV_BLOCK_TOKENS + index % KV_BLOCK_TOKENS
        seen = index <= (length - width + torch.arange(width)).unsqueeze(-1)  # [T, length]
        row_keys, row_values = (t[slots].transpose(0, 1)[None] for t in (keys, values))
        outputs.append(
            F.scaled_dot_product_attention(query[row : row + 1], row_keys, row_values, seen, enable_gqa=True)
        )
    return torch.cat(outputs).transpose(1, 2)


@pytest.mark.parametrize("width", [1, 5])  # a decode step; a prefill piece after a cached prefix
@pytest.mark.parametrize("compiled", [False, True])
def test_attention_through_the_block_tables_is_the_gathered_copys(width, compiled):
    lengths = [5, 33, 17, 48]
    keys, values, table = a_pool_and_tables(lengths)
    query = torch.randn(len(lengths), HEADS, width, DIM, generator=torch.Generator().manual_seed(1))
    block_mask = paged_block_mask(table, torch.tensor(lengths), width, POOL_BLOCKS, KV_BLOCK_TOKENS)
    # compiled: the GPU's path (inductor's CPU template here), which visits the listed blocks only
    bucket = block_mask.shape[0]  # the kernel's rows: a power of two, the padding rows seeing nothing
    assert bucket == row_bucket(len(lengths)) == MIN_ROW_BUCKET
    keys_seen, values_seen = pool_sequence(keys, bucket), pool_sequence(values, bucket)
    got = paged_attention(query, keys_seen, values_seen, block_mask, DIM**-0.5, compiled)
    torch.testing.assert_close(got, gathered_attention(query, keys, values, table, lengths, width))


@pytest.fixture(scope="module")
def backend():
    return make_backend(ModelSpec(name_or_path="retrain:tiny_qwen3", lora_rank=4))


@pytest.mark.parametrize(("prefix_caching", "block_tokens"), [(True, 16), (False, 16), (True, 64)])
def test_the_engine_samples_the_same_reading_the_pool_or_a_gathered_copy(backend, prefix_caching, block_tokens):
    prompt_ids = encode(backend, PROMPTS)
    gathered = make_engine(backend, prefix_caching=prefix_caching, paged_attention="gather")
    expected = gathered.generate(prompt_ids, GROUP, SAMPLING, 6)
    wide = block_tokens // KV_BLOCK_TOKENS
    for blocks in (one_row_blocks(prompt_ids, block_tokens), 30 // wide):  # rows queue, are preempted; all at once
        engine = make_engine(
            backend,
            prefix_caching=prefix_caching,
            paged_attention="flex",
            kv_block_tokens=block_tokens,
            kv_cache_gb=budget_gb(gathered, blocks * wide),
        )
        assert engine.paged_attention
        assert_same_rollouts(engine.generate(prompt_ids, GROUP, SAMPLING, 6), expected)


def test_the_mode_is_checked_and_flex_needs_a_mirrored_forward(backend):
    with pytest.raises(ConfigError, match="inference.paged_attention='paged'"):
        PytorchEngineConfig(paged_attention="paged")
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    config = MistralConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, vocab_size=50
    )
    sliding = AutoModelForCausalLM.from_config(config)  # a sliding window: transformers' forward runs
    with pytest.raises(ConfigError, match="inference.paged_attention=flex"):
        reads_the_pool("flex", sliding, cpu)
    assert [reads_the_pool(mode, backend.model, cpu) for mode in ("auto", "gather", "flex")] == [False, False, True]
    assert not reads_the_pool("gather", backend.model, cuda)
    assert reads_the_pool("auto", backend.model, cuda) == has_triton()  # a GPU's kernel is compiled by triton
    if has_triton():
        assert reads_the_pool("flex", backend.model, cuda)
    else:
        with pytest.raises(ConfigError, match="inference.paged_attention=flex compiles its kernel with triton"):
            reads_the_pool("flex", backend.model, cuda)


def test_the_pool_never_hands_attention_uninitialised_slots():
    """Attention reads whole blocks (flex: a row's last block past its length; eager: the whole pool) and weighs
    the masked slots 0, but 0 · NaN is NaN: slots nobody wrote must hold zeros, whatever memory the pool got."""
    shape = KvShape(layers=1, kv_heads=1, head_dim=4, dtype=torch.float32)  # small: malloc reuses freed memory
    for _ in range(3):
        torch.full((GROWTH_MIN_BLOCKS * KV_BLOCK_TOKENS, 1, 4), float("nan"))  # freed at once, NaN left behind
        pool = KvPool(shape, torch.device("cpu"), 256)
        pool.take(GROWTH_MIN_BLOCKS + 1)  # two growths
        assert all(bool(torch.isfinite(storage).all()) for storage in (*pool.keys, *pool.values))


def test_rows_are_bucketed_to_powers_of_two_so_a_decode_compiles_a_few_shapes():
    assert [row_bucket(rows) for rows in (1, 7, 8, 9, 16, 17, 128, 129)] == [8, 8, 8, 16, 16, 32, 128, 256]


def test_the_block_mask_grows_with_rows_times_pool_blocks_not_with_tokens():
    """A decode step's block mask at Qwen3-4B's real scale: 128 rows of 10,240 tokens each (640 blocks) over a
    40 GiB pool (36 layers × 8 KV heads × 128 × 2 × bf16 = 144 KiB a token, 2.25 MiB a block: 18,204 blocks).
    Its tensors are the rows' place of each pool block (int64) and the listed blocks (int32): 12 bytes per row
    and pool block, ~27 MiB, whatever the rows' lengths; nothing of size rows × tokens or of the vocabulary."""
    rows, pool_blocks, row_blocks = 128, (40 * 2**30) // (16 * 36 * 8 * 128 * 2 * 2), 640
    table = torch.arange(rows * row_blocks).view(rows, row_blocks) % pool_blocks
    lengths = torch.full((rows,), row_blocks * KV_BLOCK_TOKENS)
    block_mask = paged_block_mask(table, lengths, 1, pool_blocks, KV_BLOCK_TOKENS)
    closure = [cell.cell_contents for cell in block_mask.mask_mod.__closure__ or ()]
    tensors = [block_mask.kv_num_blocks, block_mask.kv_indices, *(c for c in closure if isinstance(c, torch.Tensor))]
    held = sum(tensor.untyped_storage().nbytes() for tensor in tensors)
    assert held <= block_mask_bytes(rows, pool_blocks)  # the memory plan's count
    assert held >= rows * pool_blocks * (8 + 4)  # ranks (int64) and kv_indices (int32): the count is not loose
