"""The adapter's gradients summed over ranks: one flat all-reduce of the LoRA gradients, before clipping.

Each rank's loss is its rows' token losses divided by the whole step's token count (all-reduced), so the sum of
the ranks' gradients is the gradient one process computes on the whole batch; every rank then clips the same
gradient and takes the same AdamW step. One flat all-reduce instead of DDP: the LoRA parameters are a few MB,
the loss is formed over micro-batches of uneven count per rank (DDP's hooks fire per backward and need every
rank to run the same number of them), and the model is shared with the in-process sampler, which DDP's wrapper
would stand between.
"""

from __future__ import annotations

import time

import torch

from retrain.distributed.world import active, all_sum


def all_reduce_gradients(parameters: list[torch.Tensor]) -> dict[str, float]:
    """Replace each parameter's gradient by its sum over ranks (a rank that trained no row contributes zeros);
    returns `dist/allreduce_time_s`, the collective's wall time (nothing on one process)."""
    if not active():
        return {}
    started = time.perf_counter()
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in parameters]
    flat = all_sum(torch.cat([g.reshape(-1) for g in grads]))
    offset = 0
    for p in parameters:
        n = p.numel()
        p.grad = flat[offset : offset + n].view_as(p).to(p.dtype).clone()
        offset += n
    return {"dist/allreduce_time_s": time.perf_counter() - started}


def weights_checksum(tensors: dict[str, torch.Tensor]) -> tuple[float, float]:
    """(Σ w, Σ w²) of the adapter in float64: equal on every rank while their adapters are bit-identical."""
    total = squares = 0.0
    for name in sorted(tensors):
        values = tensors[name].detach().double()
        total += float(values.sum())
        squares += float((values * values).sum())
    return total, squares
