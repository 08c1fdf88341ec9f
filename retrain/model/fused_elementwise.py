"""The training forward's two elementwise chains as one kernel each way: the rotary embedding and SiLU·up.

Under autograd every op of `x·cos + roll(x)·sin` and of `silu(gate)·up`, and every op of their backward, is a
kernel that reads and writes whole activations. At Qwen3-4B's shape those ops moved at least 39% of a layer's
bytes outside the matmuls (docs/benchmarks.md, "The training step's MFU ceiling"). torch.compile fuses each into
one kernel forward and one backward. With `emulate_precision_casts` each intermediate is rounded to the dtype as
the eager ops round it, so a bf16 model's fused chains give the eager bits, forward and backward (the sampler,
which runs them eagerly, and the trainer stay one arithmetic); in fp32 SiLU's backward is within rounding. The
fused SiLU·up keeps gate and up for backward, not SiLU's output: one [tokens, intermediate] tensor less a layer
(the memory plan's `fused_mlp`).

`backend.fused_elementwise` decides (`fuses_elementwise`: auto is on for a GPU with triton; a CPU compiles them
too when asked). Only autograd's forward fuses: without it (sampling, the probe, the KL reference) the chains
stay eager ops, which a decode step's CUDA graph records as they are. While retrain/model/counting.py counts,
a fused chain runs eagerly and counts as the two kernels (retrain/model/fused_counting.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._triton import has_triton

from retrain.errors import ConfigError
from retrain.model.fused_counting import FusedCounter, counted_fused

_ATTRIBUTE = "_retrain_fused_elementwise"  # on the transformers causal LM: whether its training forward fuses
_COUNTER: ContextVar[FusedCounter | None] = ContextVar("fused_elementwise_counter", default=None)


def fuses_elementwise(mode: str, device: torch.device) -> bool:
    """`backend.fused_elementwise` resolved for a trainer on `device`: auto fuses on a GPU with triton (the CPU's
    compiler makes each first step compile for tens of seconds, for little a small model gains); true anywhere but
    a GPU without triton (a ConfigError)."""
    if mode == "true" and device.type == "cuda" and not has_triton():
        raise ConfigError("backend.fused_elementwise=true needs triton on a GPU (pip install triton)")
    return mode == "true" or (mode == "auto" and device.type == "cuda" and has_triton())


def mark_fused(causal_lm: Any, fused: bool) -> None:
    """Tell the lean forward (retrain/model/lean_decoder.py) whether `causal_lm`'s training forward fuses."""
    setattr(causal_lm, _ATTRIBUTE, fused)


def marked_fused(causal_lm: Any) -> bool:
    return bool(getattr(causal_lm, _ATTRIBUTE, False))


def rotated(tensor: torch.Tensor, rotation: tuple[torch.Tensor, torch.Tensor], fused: bool) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb on [B, T, heads, head_dim] (`rotation`: cos and the signed sin, see
    lean_decoder.py), one kernel each way where `fused` and autograd records."""
    cos, signed_sin = rotation
    if fused and _records(tensor):
        return _fused("rotary", _rotated, (tensor, cos, signed_sin), backward_reads=(1, 2))
    return _rotated(tensor, cos, signed_sin)


def silu_times(gate: torch.Tensor, up: torch.Tensor, fused: bool) -> torch.Tensor:
    """silu(gate)·up, one kernel each way where `fused` and autograd records."""
    if fused and (_records(gate) or _records(up)):
        return _fused("silu_times", _silu_times, (gate, up), backward_reads=(0, 1))
    return _silu_times(gate, up)


@contextmanager
def counted_by(counter: FusedCounter) -> Iterator[None]:
    """Within the block, fused chains run eagerly and `counter` counts them as their kernels."""
    token = _COUNTER.set(counter)
    try:
        yield
    finally:
        _COUNTER.reset(token)


def _records(tensor: torch.Tensor) -> bool:
    return tensor.requires_grad and torch.is_grad_enabled()


def _fused(
    name: str, chain: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...], backward_reads: tuple[int, ...]
) -> torch.Tensor:
    counter = _COUNTER.get()
    if counter is not None:
        return counted_fused(counter, name, chain, inputs, backward_reads)
    return _compiled(chain)(*inputs)


@functools.cache
def _compiled(chain: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`chain` compiled once for every shape (the trainer's lengths vary step by step), rounding as eager does."""
    return torch.compile(chain, dynamic=True, fullgraph=True, options={"emulate_precision_casts": True})


def _rotated(tensor: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x·cos + rotate_half(x)·sin, to the bit: rotate_half's cat and negation as one roll (the sign is in the
    signed sin)."""
    return tensor * cos + tensor.roll(tensor.shape[-1] // 2, -1) * signed_sin


def _silu_times(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up
