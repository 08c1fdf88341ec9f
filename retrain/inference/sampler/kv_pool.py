"""The sampler's keys and values, paged: fixed-size blocks in one pool per layer, allocated as tokens arrive.

Why paged rather than one growing [rows, heads, length, dim] buffer: rows of an RL batch stop at very
different lengths, and a dense buffer holds every row at the longest one, copies the whole cache whenever a
row leaves, and must be sized for B·G·max_tokens to avoid copies. A block pool holds each row's tokens in
blocks of `KvShape.block_tokens` slots (`inference.kv_block_tokens`) listed in the row's block table, so memory
follows the live tokens; a finished row's blocks go back to a free list for the next row; the G rows of a group
share their prompt's blocks (reference counts; the scheduler copies a shared block before a row writes into it).

The storage grows as blocks are taken, by GROWTH (and GROWTH_MIN_BLOCKS) at a time (the copy of a block pool into its larger
successor is amortised), one layer after the other so that a growth holds at most one layer's old storage
twice, and never beyond `max_blocks`: the KV budget. It lives within one sampling call.

On a GPU the engine reserves the whole budget at the call's start instead (`reserve`): growing there would copy
the pool while the call decodes and leave the caching allocator blocks of every intermediate size; one
allocation of the same size per call is reused from its cache call after call. (On a CPU the growth keeps
`engine/kv_reserved_gb`, and the pages written, at what the call needed.)

New storage is zeroed, not left as whatever memory it got: attention over the pool reads slots no row wrote
(a row's last block past its length, and with eager flex_attention every slot) and weighs them 0, but 0 · NaN
is NaN. A memset of the new storage, once per growth or per call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from retrain.inference.config import KV_BLOCK_TOKENS

GROWTH = 1.5  # the storage grows to at least 1.5x its capacity, so its copies cost O(1) per block taken
GROWTH_MIN_BLOCKS = 64  # and by at least this many blocks: a call's first admissions take a few growths, not ten
ATTENTION_LAYER_KINDS = ("full_attention", "sliding_attention")  # layers whose keys and values the pool holds


@dataclass(frozen=True)
class KvShape:
    """What one token's keys and values take: per layer, `kv_heads` heads of `head_dim` in `dtype`; and the pool's
    blocks, `block_tokens` token slots each."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_tokens: int = KV_BLOCK_TOKENS

    @classmethod
    def of(cls, config: Any, dtype: torch.dtype, block_tokens: int = KV_BLOCK_TOKENS) -> KvShape:
        """The shape a transformers decoder's config gives (its text config, for a multimodal model); ValueError
        for a model with layers that keep other state than keys and values (linear attention, SSM layers)."""
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        kinds = set(getattr(text, "layer_types", None) or ()) - set(ATTENTION_LAYER_KINDS)
        if kinds:
            raise ValueError(
                f"inference=pytorch pages keys and values, but {text.model_type} has layers of kind "
                f"{', '.join(sorted(kinds))}; sample it with inference=vllm"
            )
        heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        return cls(text.num_hidden_layers, kv_heads, head_dim, dtype, block_tokens)

    @property
    def bytes_per_token(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()

    @property
    def block_bytes(self) -> int:
        return self.block_tokens * self.bytes_per_token

    def blocks_for(self, tokens: int) -> int:
        """Blocks that hold `tokens` token slots."""
        return -(-tokens // self.block_tokens)


class KvPool:
    """Keys and values of every layer in blocks; see the module docstring. A block's token slots are
    [block · block_tokens, (block + 1) · block_tokens) of each layer's [slots, kv_heads, head_dim] storage."""

    def __init__(
        self, shape: KvShape, device: torch.device, max_blocks: int, reserve: bool = False, sink: bool = False
    ) -> None:
        """`reserve`: the storage takes all `max_blocks` at once, and never grows (a GPU's: see the module
        docstring); else it grows as blocks are taken. `sink`: one of the reserved blocks is no row's, the
        `sink` that a recorded decode step's padding rows write to (step_graphs.py)."""
        self.shape = shape
        self.device = device
        self.max_blocks = max_blocks
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.capacity = 0  # blocks the storage holds
        self.free: list[int] = []  # a stack: the block released last is reused first
        self.refs: list[int] = []  # holders of each block (rows and prompt entries)
        self.in_use = 0
        self.peak_in_use = 0
        self.peak_capacity = 0
        self.sink: int | None = None
        if reserve:
            self._grow(max_blocks)
        if sink:
            if not reserve:
                raise ValueError("a sink block needs the storage reserved: growing would move it")
            self.sink = self.free.pop(0)  # the last block; held for good, so never taken or freed
            self.refs[self.sink] = 1

    def available(self) -> int:
        """Blocks that can be taken now: free ones and those the storage may still grow by."""
        return len(self.free) + self.max_blocks - self.capacity

    def take(self, count: int) -> list[int]:
        """`count` blocks, held once each; the caller made sure they are available."""
        if count > self.available():
            raise RuntimeError(f"the KV pool has {self.available()} blocks left, {count} were asked for")
        if count > len(self.free):
            self._grow(count - len(self.free))
        blocks = [self.free.pop() for _ in range(count)]
        for block in blocks:
            self.refs[block] = 1
        self.in_use += count
        self.peak_in_use = max(self.peak_in_use, self.in_use)
        return blocks

    def share(self, blocks: list[int]) -> None:
        """One more holder of each of `blocks`."""
        for block in blocks:
            self.refs[block] += 1

    def release(self, blocks: list[int]) -> None:
        """One holder fewer of each of `blocks`; a block nobody holds is free again."""
        for block in blocks:
            self.refs[block] -= 1
            if self.refs[block] == 0:
                self.free.append(block)
                self.in_use -= 1

    def shared(self, block: int) -> bool:
        return self.refs[block] > 1

    def copy(self, sources: list[int], targets: list[int]) -> None:
        """Every layer's keys and values of blocks `sources` into blocks `targets`."""
        if not sources:
            return
        block_tokens = self.shape.block_tokens
        offsets = torch.arange(block_tokens, device=self.device)
        blocks = torch.tensor([sources, targets], device=self.device)  # one copy from the host, not two
        source, target = (blocks.unsqueeze(-1) * block_tokens + offsets).flatten(1)
        for storage in (*self.keys, *self.values):
            storage.index_copy_(0, target, storage.index_select(0, source))

    def _grow(self, at_least: int) -> None:
        wanted = max(self.capacity + at_least, math.ceil(self.capacity * GROWTH), self.capacity + GROWTH_MIN_BLOCKS)
        capacity = min(self.max_blocks, wanted)
        slots = capacity * self.shape.block_tokens
        for storages in (self.keys, self.values):
            for layer in range(self.shape.layers):
                grown = torch.zeros(  # never garbage: see the module docstring
                    (slots, self.shape.kv_heads, self.shape.head_dim), dtype=self.shape.dtype, device=self.device
                )
                if layer < len(storages):
                    grown[: storages[layer].shape[0]].copy_(storages[layer])
                    storages[layer] = grown  # the old storage goes before the next layer grows
                else:
                    storages.append(grown)
        self.free.extend(range(capacity - 1, self.capacity - 1, -1))  # popped in ascending order
        self.refs.extend([0] * (capacity - self.capacity))
        self.capacity = capacity
        self.peak_capacity = max(self.peak_capacity, capacity)
