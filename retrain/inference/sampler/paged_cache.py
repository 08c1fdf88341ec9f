"""The KV pool as transformers' Cache: what one forward writes into the pool and what its attention reads.

Before each forward the decode loop sets a `ForwardPlan` on the cache, the same for every layer: the pool
slots the forward's new keys and values go to, and the slots attention reads for each row. Rows are laid
out as the engine's left-padded batches always were: each row's tokens right-aligned in a [R, W] grid (W its
longest row), its new tokens the last ones, so transformers' (and the lean forward's) mask of the cache's
`past` = W − T columns and the T new ones — causal, without the padding columns — is exactly right.

Attention over cached keys reads them one of two ways (`inference.paged_attention`). Gather: a dense
[R, kv_heads, W, head_dim] copy of one layer at a time (sdpa takes no block tables): one layer's live keys and
values, padded to the longest row, is the transient this costs. A padding column reads its row's first slot, a
real key, so that no uninitialised memory reaches the kernel (masked keys weigh 0, but 0 · NaN is NaN). Flex: the
pool itself, through the block tables (paged_attention.py), when the forward is the lean one (the cache's own
`attention` replaces the model's attention function there; transformers' forward knows no block mask).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.attention.flex_attention import BlockMask
from transformers import Cache
from transformers.cache_utils import CacheLayerMixin

from retrain.inference.sampler.kv_pool import KvPool
from retrain.inference.sampler.paged_attention import paged_attention, paged_block_mask, pool_sequence


@dataclass(frozen=True)
class ForwardPlan:
    """Where one forward's keys and values go, and what its attention reads."""

    input_ids: torch.Tensor  # [R, T] new tokens, right-aligned (padding on the left)
    # [R, W] long: the real columns of the grid; a decode step's None when no row is padded (known on the host,
    # so the forward never looks at the values to decide)
    attention_mask: torch.Tensor | None
    position_ids: torch.Tensor  # [R, T]
    sources: torch.Tensor | None  # [n] the real new tokens among the forward's R·T (None: all of them)
    targets: torch.Tensor  # [n] the pool slots they are written to
    reads: torch.Tensor | None  # [R·W] the slots attention gathers (None: its own keys, or the pool's: block_mask)
    block_mask: BlockMask | None  # attention reads the pool through the block tables (flex), not a gathered copy
    grid: int  # W: the longest row's length
    padded: bool  # a row is shorter than W: attention_mask has padding columns

    @property
    def past(self) -> int:
        return self.grid - self.input_ids.shape[1]


def plan_forward(
    table: torch.Tensor,
    lengths: torch.Tensor,
    bounds: tuple[int, int],
    new_tokens: torch.Tensor,
    new_mask: torch.Tensor | None,
    block_tokens: int,
    pool_blocks: int | None = None,
) -> ForwardPlan:
    """The plan of a forward over rows with block tables `table` ([R, blocks]) and `lengths` ([R] on the device:
    tokens stored after it; `bounds` their smallest and largest, known on the host) that feeds them `new_tokens`
    ([R, T], right-aligned; `new_mask` marks the real ones, None: all). The rows' blocks must already hold
    `lengths` slots, the written ones held by the row alone; `block_tokens`: the pool's slots a block. `pool_blocks`:
    the pool's size, where attention reads cached keys from the pool through the block tables (None: from a
    gathered copy)."""
    shortest, grid = bounds
    width = new_tokens.shape[1]
    device = new_tokens.device
    if grid > width == 1 and new_mask is None and pool_blocks is not None:
        # (prefill pieces after a cached prefix gather: few, and compute-bound)
        return plan_paged_decode(table, lengths, new_tokens, block_tokens, pool_blocks, grid)
    columns = torch.arange(grid, device=device)
    index = columns - (grid - lengths).unsqueeze(-1)  # [R, W] the row's token in each column; < 0: padding
    real = index >= 0
    slots = _slots_of(table, index.clamp_min(0), block_tokens)
    new_slots = slots[:, grid - width :]
    if new_mask is None:
        sources, targets = None, new_slots.reshape(-1)
        positions = (lengths - width).unsqueeze(-1) + torch.arange(width, device=device)
    else:
        sources, targets = new_mask.reshape(-1).nonzero().squeeze(-1), new_slots[new_mask]
        positions = ((lengths - width).unsqueeze(-1) + torch.arange(width, device=device)).clamp_min(0)
    reads = None if grid == width else slots.reshape(-1)
    mask = None if width == 1 and shortest == grid else real.long()
    return ForwardPlan(new_tokens, mask, positions, sources, targets, reads, None, grid, shortest < grid)


def plan_paged_decode(
    table: torch.Tensor, lengths: torch.Tensor, new_tokens: torch.Tensor, block_tokens: int, pool_blocks: int, grid: int
) -> ForwardPlan:
    """The plan of a decode step whose attention reads the pool through the block tables: only the new token's
    slot, no [R, W] grid of them; arguments as `plan_forward` takes them (`grid`: the longest row's length, which
    only transformers' forward asks for). Built from device tensors alone, so a recorded step rebuilds it when
    replayed (step_graphs.py)."""
    positions = (lengths - 1).unsqueeze(-1)
    targets = _slots_of(table, positions, block_tokens).reshape(-1)
    block_mask = paged_block_mask(table, lengths, 1, pool_blocks, block_tokens)
    return ForwardPlan(new_tokens, None, positions, None, targets, None, block_mask, grid, False)


def _slots_of(table: torch.Tensor, index: torch.Tensor, block_tokens: int) -> torch.Tensor:
    """The pool slots of the rows' tokens `index` ([R, n], each row's own positions) through their block tables."""
    return table.gather(1, index // block_tokens) * block_tokens + index % block_tokens


class PagedLayer(CacheLayerMixin):
    """One layer's view of the pool for transformers: stores a forward's keys and values, returns what it reads."""

    is_sliding = False  # the pool keeps every key; a sliding-window layer's mask (transformers') limits the window

    def __init__(self, writes: PoolWrites, index: int, sliding: bool) -> None:
        super().__init__()
        self.writes, self.index, self.is_sliding = writes, index, sliding
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to set up: the pool holds the storage."""

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.writes.store(self.index, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.writes.plan.past + query_length, 0

    def get_seq_length(self) -> int:
        return self.writes.plan.past

    def get_max_length(self) -> int:
        return -1


class PoolWrites:
    """The pool and the plan of the forward under way: what the cache and each of its layers share. The layers
    hold this, not the cache, so that no reference cycle keeps the pool (on a GPU the whole KV budget) after its
    call until Python's cycle collector runs: then the trainer would meet it still allocated."""

    def __init__(self, pool: KvPool) -> None:
        self.pool = pool
        self._plan: ForwardPlan | None = None

    @property
    def plan(self) -> ForwardPlan:
        if self._plan is None:
            raise RuntimeError("a forward on the paged KV cache needs its plan first")
        return self._plan

    @plan.setter
    def plan(self, plan: ForwardPlan) -> None:
        self._plan = plan

    def store(
        self, layer: int, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write layer `layer`'s new [R, heads, T, dim] keys and values into the pool; return what attention reads."""
        plan = self.plan
        rows, heads, width, dim = key_states.shape
        pool_keys, pool_values = self.pool.keys[layer], self.pool.values[layer]
        for new, storage in ((key_states, pool_keys), (value_states, pool_values)):
            tokens = new.transpose(1, 2).reshape(rows * width, heads, dim)
            storage.index_copy_(
                0, plan.targets, tokens if plan.sources is None else tokens.index_select(0, plan.sources)
            )
        if plan.block_mask is not None:
            bucket = plan.block_mask.shape[0]
            return pool_sequence(pool_keys, bucket), pool_sequence(pool_values, bucket)
        if plan.reads is None:
            return key_states, value_states
        grid = plan.grid
        keys = pool_keys.index_select(0, plan.reads).view(rows, grid, heads, dim).transpose(1, 2)
        values = pool_values.index_select(0, plan.reads).view(rows, grid, heads, dim).transpose(1, 2)
        return keys, values


class PagedCache(Cache):
    """transformers' Cache over a KvPool; the decode loop sets `plan` before every forward."""

    def __init__(self, pool: KvPool, layer_types: list[str] | None) -> None:
        kinds = layer_types or ["full_attention"] * pool.shape.layers
        self.writes = PoolWrites(pool)
        super().__init__(
            layers=[PagedLayer(self.writes, i, kind == "sliding_attention") for i, kind in enumerate(kinds)]
        )

    @property
    def pool(self) -> KvPool:
        return self.writes.pool

    @property
    def plan(self) -> ForwardPlan:
        return self.writes.plan

    @plan.setter
    def plan(self, plan: ForwardPlan) -> None:
        self.writes.plan = plan

    def attention(self) -> Any | None:
        """The attention function (transformers' interface) of this forward where the cache brings its own:
        the pool read through the block tables; None: the model's own, over what `store` returns."""
        block_mask = self.plan.block_mask
        if block_mask is None:
            return None

        def attend(
            module: Any, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, *args: Any, **kwargs: Any
        ) -> tuple[torch.Tensor, None]:
            return paged_attention(query, keys, values, block_mask, kwargs["scaling"], query.is_cuda), None

        return attend
