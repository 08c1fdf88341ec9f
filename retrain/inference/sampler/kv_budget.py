"""How much memory the sampler's KV cache may take: `inference.kv_cache_gb`, else the memory plan's budget,
else what the device has free less a margin, and the check that one row at its longest fits in it."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from retrain.errors import ConfigError
from retrain.inference.sampler.kv_pool import KvShape

KEY = "inference.kv_cache_gb"
GIB = 2**30  # `inference.kv_cache_gb` counts GiB, as the memory plan does
# automatic budget without a plan: the device's free memory less this share of it (at least AUTO_MARGIN_MIN),
# left for the decode step's logits, attention's per-layer copy of the keys and values, and the allocator's slack
AUTO_MARGIN_SHARE = 0.1
AUTO_MARGIN_MIN = GIB
SIZE_CLASS_BITS = 4  # an automatic budget is one of 8 sizes per doubling (`size_class`)


@dataclass(frozen=True)
class KvBudget:
    """A KV budget in bytes, and how it was set (for the error that names the key)."""

    bytes: int
    source: str


def kv_budget(configured_gb: float, planned_bytes: int | None, device: torch.device) -> KvBudget:
    """The budget of one sampling call: the configured GiB, the plan's bytes, or the device's free memory less
    the margin (read at each call: training's memory comes and goes)."""
    if configured_gb > 0:
        return KvBudget(int(configured_gb * GIB), f"{KEY}={configured_gb:g}")
    if planned_bytes is not None:
        return KvBudget(planned_bytes, f"the memory plan's budget for {KEY}=0 ({planned_bytes / GIB:.3g} GiB)")
    free = free_bytes(device)
    usable = size_class(max(0, free - max(AUTO_MARGIN_MIN, int(AUTO_MARGIN_SHARE * free))))
    return KvBudget(usable, f"{KEY}=0: {device.type}'s free memory ({free / GIB:.3g} GiB) less a margin")


def size_class(size: int) -> int:
    """`size` rounded down to its leading SIZE_CLASS_BITS bits (at most 1/8 less with 4): the free memory moves a
    little between calls, and each new pool size compiles a GPU's paged-attention kernel again (its shape is the
    pool's), so calls whose free memory differs a little take the same pool."""
    shift = max(0, size.bit_length() - SIZE_CLASS_BITS)
    return (size >> shift) << shift


def free_bytes(device: torch.device) -> int:
    """Memory `device` can still give: CUDA's free memory and what torch's allocator holds unused; on CPU
    the kernel's MemAvailable (or the free pages where there is no /proc/meminfo)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if device.type == "cpu":
        meminfo = Path("/proc/meminfo")
        if meminfo.exists():
            for line in meminfo.read_text().splitlines():
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    raise ConfigError(f"inference=pytorch cannot read the free memory of a {device.type} device: set {KEY}")


def blocks_holding(rows: int, row_blocks: int, sink: bool = False) -> int:
    """Pool blocks that hold `rows` rows of `row_blocks` blocks each at once, none sharing a prompt: theirs, the
    copy a row makes of its shared prompt block, and the pool's `sink` block, which no row takes (step_graphs.py)."""
    return rows * row_blocks + 1 + int(sink)


def rows_held(blocks: int, row_blocks: int, sink: bool = False) -> int:
    """The most rows of `row_blocks` blocks `blocks` pool blocks hold at once (`blocks_holding` inverted; 0: not
    one, which `budget_blocks` refuses). The memory plan counts with it what the engine will."""
    return max(0, (blocks - blocks_holding(0, row_blocks, sink)) // row_blocks)


def budget_blocks(budget: KvBudget, shape: KvShape, longest_row: int, sink: bool = False) -> int:
    """Blocks the budget holds; ConfigError naming the key when they cannot hold one row of `longest_row`
    tokens (a prompt and max_tokens) beside the blocks `blocks_holding` adds."""
    blocks = budget.bytes // shape.block_bytes
    row_blocks = shape.blocks_for(longest_row)
    if rows_held(blocks, row_blocks, sink) == 0:
        need = blocks_holding(1, row_blocks, sink)
        raise ConfigError(
            f"the KV cache budget ({budget.source}) holds {blocks * shape.block_bytes / GIB:.3g} GiB, but one row "
            f"of {longest_row} tokens (the longest prompt and max_tokens) needs {need * shape.block_bytes / GIB:.3g} "
            f"GiB ({shape.bytes_per_token} bytes per token): raise {KEY} or lower max_tokens"
        )
    return blocks
