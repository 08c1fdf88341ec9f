"""Fused kernels counted as the kernels a GPU runs, where a CPU runs their composite ops.

- torch's rms_norm: on CUDA `F.rms_norm` is `_fused_rms_norm` (it saves its input and one fp32 rstd per row) and its
  backward `_fused_rms_norm_backward`. A CPU has neither kernel where autograd is on: it runs the composite (an
  fp32 copy, square, mean, rsqrt, two products, a cast) and its backward, ~25 ops. While `OpCounter`
  (retrain/model/counting.py) counts, `F.rms_norm` is `counted_rms_norm(counter)`.
- The rotary embedding and SiLU·up compiled under autograd (retrain/model/fused_elementwise.py): one kernel each way.

Each call runs its composite with the counter paused, and one kernel forward and one backward are counted in its
stead: the forward reads its inputs and writes its output; the backward reads the output's gradient and the inputs
it needs, and writes their gradients.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

FP32 = 4


class FusedCounter(Protocol):
    def pausing(self) -> Any: ...

    def fused(self, name: str, moved: int) -> None: ...


def counted_fused(
    counter: FusedCounter,
    name: str,
    chain: Callable[..., torch.Tensor],
    inputs: tuple[torch.Tensor | None, ...],
    backward_reads: tuple[int, ...],
    extra_bytes: int = 0,
) -> torch.Tensor:
    """`chain(*inputs)`, counted by `counter` as kernel `name` and `name`_backward. `backward_reads`: the inputs
    the backward kernel reads; `extra_bytes`: what each kernel moves besides (rms_norm's rstd)."""
    return _CountedFusion.apply(counter, name, chain, backward_reads, extra_bytes, *inputs)


def counted_rms_norm(counter: FusedCounter, rms_norm: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`rms_norm` (torch's own), counted by `counter` as the fused kernels."""

    def counted(
        input: torch.Tensor, normalized_shape: Any, weight: torch.Tensor | None = None, eps: float | None = None
    ) -> torch.Tensor:
        shape = tuple(normalized_shape)
        rstd = input.numel() // max(1, torch.Size(shape).numel()) * FP32  # one fp32 rstd per normalised row

        def norm(hidden: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
            return rms_norm(hidden, shape, scale, eps)

        return counted_fused(counter, "rms_norm", norm, (input, weight), backward_reads=(0, 1), extra_bytes=rstd)

    return counted


def _bytes(*tensors: torch.Tensor | None) -> int:
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors if tensor is not None)


class _CountedFusion(torch.autograd.Function):
    """A chain computed as the CPU computes it (uncounted), counted as one fused kernel each way."""

    @staticmethod
    def forward(
        ctx: Any,
        counter: FusedCounter,
        name: str,
        chain: Callable[..., torch.Tensor],
        backward_reads: tuple[int, ...],
        extra_bytes: int,
        *inputs: torch.Tensor | None,
    ) -> torch.Tensor:
        with counter.pausing():
            output = chain(*inputs)
        counter.fused(name, _bytes(*inputs, output) + extra_bytes)
        ctx.counter, ctx.name, ctx.chain = counter, name, chain
        ctx.backward_reads, ctx.extra_bytes = backward_reads, extra_bytes
        ctx.save_for_backward(*inputs)
        return output

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        inputs = ctx.saved_tensors
        wanted = [
            needed and tensor is not None for needed, tensor in zip(ctx.needs_input_grad[5:], inputs, strict=True)
        ]
        with ctx.counter.pausing(), torch.enable_grad():
            leaves = [
                None if tensor is None else tensor.detach().requires_grad_(want)
                for tensor, want in zip(inputs, wanted, strict=True)
            ]
            output = ctx.chain(*leaves)
            asked = [leaf for leaf, want in zip(leaves, wanted, strict=True) if want and leaf is not None]
            found = iter(torch.autograd.grad(output, asked, grad))
        grads = [next(found) if want else None for want in wanted]
        read = _bytes(grad, *(inputs[index] for index in ctx.backward_reads)) + ctx.extra_bytes
        ctx.counter.fused(f"{ctx.name}_backward", read + _bytes(*grads))
        return (None, None, None, None, None, *grads)
