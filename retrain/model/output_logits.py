"""The LM head's logits in fp32 on a GPU, for the sampler and the trainer alike.

A bf16 model's head rounds each logit to bf16: 8 bits of mantissa, an error of up to 2^-5 on a logit of 8-16,
which goes straight into every log-prob. The sampler and the trainer each round their own logits (from hidden
states computed in batches of other shapes), so the gap between their log-probs, `engine/logprob_abs_diff`, would
be ~1e-2 on a GPU where the CPU's fp32 run shows ~1e-6. On CUDA the head's matmul writes fp32 instead
(`torch.mm(..., out_dtype=torch.float32)`: bf16 operands, fp32 accumulation as before, no rounding of the result):
the same kernel's work, with twice the bytes of the [tokens, vocabulary] output, which the log-softmax then reads
in fp32 anyway. That matmul has no autograd formula, so the trainer's goes through `_Fp32Logits` (the same
backward a bf16 linear has: the gradient cast to the weights' dtype, then two matmuls).

Elsewhere (the CPU, whose kernels have no such matmul; an fp32 model; a head with a bias or a LoRA adapter) the
head runs as it is. `ModelSpec.load_lora_model` sets this up for every model it loads.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

HALF = (torch.bfloat16, torch.float16)


def use_fp32_logits(model: Any) -> None:
    """From now on a half-precision model on a GPU writes its logits in fp32 (see the module docstring), through
    every forward that calls its output embedding (transformers', the lean one, the trainer's chunks): the
    module's own forward is shadowed by an instance attribute, so its hooks still run."""
    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = causal_lm.get_output_embeddings()
    plain = type(head) is torch.nn.Linear and head.bias is None
    if plain and head.weight.is_cuda and head.weight.dtype in HALF:
        head.forward = partial(_fp32_forward, head)


def _fp32_forward(head: torch.nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    """[..., vocabulary] fp32 logits of [..., hidden] half-precision hidden states on a GPU (a copy of the model
    moved off it computes as the head does)."""
    if not hidden.is_cuda:
        return torch.nn.functional.linear(hidden, head.weight)
    rows = hidden.reshape(-1, hidden.shape[-1])
    if torch.is_grad_enabled() and (rows.requires_grad or head.weight.requires_grad):
        logits = _Fp32Logits.apply(rows, head.weight)
    else:
        logits = torch.mm(rows, head.weight.t(), out_dtype=torch.float32)
    return logits.view(*hidden.shape[:-1], -1)


class _Fp32Logits(torch.autograd.Function):
    """rows · weightᵀ written in fp32, with a half-precision linear's backward (the gradient cast to its dtype)."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(rows, weight)
        return torch.mm(rows, weight.t(), out_dtype=torch.float32)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        rows, weight = ctx.saved_tensors
        grad = grad.to(weight.dtype)
        grad_rows = grad @ weight if ctx.needs_input_grad[0] else None
        grad_weight = grad.t() @ rows if ctx.needs_input_grad[1] else None
        return grad_rows, grad_weight
