"""torch's rms_norm counted as the kernels a GPU runs: one fused kernel forward and, under autograd, one backward.

On CUDA `F.rms_norm` is `_fused_rms_norm` (it saves its input and one fp32 rstd per row) and its backward
`_fused_rms_norm_backward`. A CPU has neither kernel where autograd is on: it runs the composite (an fp32 copy,
square, mean, rsqrt, two products, a cast) and its backward, ~25 ops. While `OpCounter`
(retrain/model/counting.py) counts, `F.rms_norm` is `counted_rms_norm(counter)`: each call runs with the counter
paused, and the fused kernels' ops and bytes are counted in its stead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

FP32 = 4


class FusedCounter(Protocol):
    def pausing(self) -> Any: ...

    def fused(self, name: str, moved: int) -> None: ...


def counted_rms_norm(counter: FusedCounter, rms_norm: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`rms_norm` (torch's own), counted by `counter` as the fused kernels."""

    def counted(
        input: torch.Tensor, normalized_shape: Any, weight: torch.Tensor | None = None, eps: float | None = None
    ) -> torch.Tensor:
        return _CountedRmsNorm.apply(counter, rms_norm, input, tuple(normalized_shape), weight, eps)

    return counted


def _rstd_bytes(hidden: torch.Tensor, shape: tuple[int, ...]) -> int:
    """One fp32 rstd per normalised row."""
    return hidden.numel() // max(1, torch.Size(shape).numel()) * FP32


def _bytes(*tensors: torch.Tensor | None) -> int:
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors if tensor is not None)


class _CountedRmsNorm(torch.autograd.Function):
    """rms_norm computed as the CPU computes it (uncounted), counted as the fused kernels."""

    @staticmethod
    def forward(
        ctx: Any,
        counter: FusedCounter,
        rms_norm: Callable[..., torch.Tensor],
        hidden: torch.Tensor,
        shape: tuple[int, ...],
        weight: torch.Tensor | None,
        eps: float | None,
    ) -> torch.Tensor:
        with counter.pausing():
            output = rms_norm(hidden, shape, weight, eps)
        counter.fused("rms_norm", _bytes(hidden, weight, output) + _rstd_bytes(hidden, shape))
        ctx.counter, ctx.rms_norm, ctx.shape, ctx.eps = counter, rms_norm, shape, eps
        ctx.save_for_backward(hidden, weight)
        return output

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        hidden, weight = ctx.saved_tensors
        wants_hidden, wants_weight = ctx.needs_input_grad[2], ctx.needs_input_grad[4]
        with ctx.counter.pausing(), torch.enable_grad():
            hidden_leaf = hidden.detach().requires_grad_(wants_hidden)
            weight_leaf = None if weight is None else weight.detach().requires_grad_(wants_weight)
            output = ctx.rms_norm(hidden_leaf, ctx.shape, weight_leaf, ctx.eps)
            pairs = ((hidden_leaf, wants_hidden), (weight_leaf, wants_weight))
            leaves = [leaf for leaf, wanted in pairs if wanted and leaf is not None]
            grads = iter(torch.autograd.grad(output, leaves, grad))
        grad_hidden = next(grads) if wants_hidden else None
        grad_weight = next(grads) if wants_weight else None
        read = _bytes(grad, hidden, weight) + _rstd_bytes(hidden, ctx.shape)
        ctx.counter.fused("rms_norm_backward", read + _bytes(grad_hidden, grad_weight))
        return None, None, grad_hidden, None, grad_weight, None
