"""Attention straight over the KV pool through the rows' block tables (torch's flex_attention): no dense copy.

The gather path (paged_cache.py) copies one layer's live keys and values into a dense [R, kv_heads, W, head_dim]
grid before sdpa reads it: per token and layer it moves the live KV about three times, times the longest row over
the row's own length, plus the grid as a transient. Here attention reads the pool itself: each layer's
[slots, kv_heads, head_dim] storage is one long key sequence that every row's queries share (a broadcast view),
and a BlockMask lists, per row, the pool blocks of its table; compiled, flex_attention visits those blocks only,
so a step reads each row's live keys and values once (its last block's empty slots aside: < BLOCK_TOKENS).

The mask function is complete on its own (a key is seen if its block is in the row's table, at a position not
after the query's), so eager flex_attention, which applies it to every key of the pool, computes the same: the
CPU's tests check eager and compiled against the gather path. Compiled is the GPU's path (eager materialises
[R, heads, T, slots] scores); on the CPU the gather path stays the default (`inference.paged_attention`).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

QUERY_BLOCK = 128  # flex_attention's query tile: a decode step's single query, or a prefill piece's, per tile
MIN_ROW_BUCKET = 8  # the kernel sees the rows padded to a power of two from here on: few shapes, few compiles


@functools.cache
def _compiled_flex_attention() -> Any:
    """flex_attention compiled per shape (a GPU's first step of each row bucket; inductor's dynamic-shape flex
    template is not relied on), built at first use: torch.compile loads dynamo, seconds a CLI need not wait."""
    return torch.compile(flex_attention, dynamic=False)


def row_bucket(rows: int) -> int:
    """The rows a kernel call computes for `rows` real ones: the next power of two, at least MIN_ROW_BUCKET."""
    return max(MIN_ROW_BUCKET, 1 << (rows - 1).bit_length())


def block_mask_bytes(rows: int, pool_blocks: int) -> int:
    """What `paged_block_mask` holds for `rows` rows over `pool_blocks` blocks, the most (the memory plan's
    count): per bucketed row and pool block its rank (int64, one spare column) and a listed block (int32)."""
    return row_bucket(rows) * ((pool_blocks + 1) * 8 + pool_blocks * 4 + 64)


def paged_block_mask(
    table: torch.Tensor, lengths: torch.Tensor, width: int, pool_blocks: int, block_tokens: int
) -> BlockMask:
    """Which pool slots each row's queries see: the rows' block tables `table` ([R, blocks]), `lengths` ([R]: tokens
    stored after the forward, the forward's `width` new ones the last), over a pool of `pool_blocks` blocks of
    `block_tokens` slots (`KvShape.block_tokens`). Its batch is `row_bucket(R)`: the
    padding rows list no block and see nothing."""
    padding = row_bucket(table.shape[0]) - table.shape[0]
    table, lengths = F.pad(table, (0, 0, 0, padding)), F.pad(lengths, (0, padding))
    rows, device = table.shape[0], table.device
    counts = (lengths + block_tokens - 1) // block_tokens  # [R] blocks each row's table lists
    columns = torch.arange(table.shape[1], device=device)
    listed = columns < counts.unsqueeze(-1)
    ranks = torch.full((rows, pool_blocks + 1), -1, dtype=torch.long, device=device)  # + a column for unlisted
    ranks.scatter_(1, torch.where(listed, table, pool_blocks), columns.expand(rows, -1))
    ranks = ranks[:, :pool_blocks]  # [R, pool blocks]: a block's place in the row's table, -1: not the row's
    first_query = lengths - width  # each row's first new token's position

    def visible(batch: torch.Tensor, head: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        rank = ranks[batch, key // block_tokens]
        return (rank >= 0) & (rank * block_tokens + key % block_tokens <= first_query[batch] + query)

    query_blocks = -(-width // QUERY_BLOCK)
    listed_blocks = min(table.shape[1], pool_blocks)  # a row's listed blocks are distinct blocks of the pool
    indices = torch.zeros((rows, 1, query_blocks, pool_blocks), dtype=torch.int32, device=device)
    indices[..., :listed_blocks] = table[:, None, None, :listed_blocks]
    return BlockMask.from_kv_blocks(
        counts.to(torch.int32).view(rows, 1, 1).expand(rows, 1, query_blocks).contiguous(),
        indices,
        BLOCK_SIZE=(QUERY_BLOCK, block_tokens),
        mask_mod=visible,
        seq_lengths=(width, pool_blocks * block_tokens),
        compute_q_blocks=False,  # what backward needs; sampling runs none
    )


def pool_sequence(storage: torch.Tensor, rows: int) -> torch.Tensor:
    """A layer's [slots, kv_heads, head_dim] storage as the [R, kv_heads, slots, head_dim] keys (or values) every
    row's queries attend over: a view, nothing copied."""
    slots, heads, dim = storage.shape
    return storage.view(1, slots, heads, dim).transpose(1, 2).expand(rows, heads, slots, dim)


def paged_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    block_mask: BlockMask,
    scaling: float,
    compiled: bool,
    kernel_options: dict[str, Any] | None = None,
) -> torch.Tensor:
    """[R, T, heads, head_dim] attention output (transformers' attention functions' layout) of [R, heads, T, dim]
    queries over `pool_sequence` keys and values of the block mask's (bucketed) rows, as `block_mask` lets each row
    see them. `compiled`: a GPU's (eager flex_attention scores every slot of the pool). `kernel_options`:
    flex_attention's, inductor's kernel settings where not its defaults (benchmarks/decode_kernels.py tries some)."""
    rows = query.shape[0]
    query = F.pad(query, (0, 0, 0, 0, 0, 0, 0, block_mask.shape[0] - rows))
    attend = _compiled_flex_attention() if compiled else flex_attention
    output = attend(
        query, keys, values, block_mask=block_mask, scale=scaling, enable_gqa=True, kernel_options=kernel_options
    )
    return output[:rows].transpose(1, 2).contiguous()
