"""A step's rows gathered from every rank's share, in rank order: the whole batch as one process samples it.

Each rank holds a contiguous share of the step's groups (World.share), so concatenating in rank order restores
the global row order. Ranks' tensors differ in width (their longest prompt or completion), so each is padded to
the widest first, on the side its layout pads: prompts on the left, completions on the right, with the values
one process would have padded with (`pad_id` for token ids, 0/False elsewhere).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn.functional as F

from retrain.distributed.world import active, collective_device, current_group, gather_objects
from retrain.types import Rollouts


def gather_rows(tensor: torch.Tensor, pad_value: float = 0, left: bool = False) -> torch.Tensor:
    """[n_r, W_r, ...] on each rank → [Σ n_r, max W_r, ...] on every rank (dim 1 padded; 1-D tensors as they are)."""
    if not active():
        return tensor
    shapes = gather_objects(tuple(tensor.shape))
    widest = max(shape[1] for shape in shapes) if tensor.dim() > 1 else 0
    most = max(shape[0] for shape in shapes)
    padded = tensor
    if tensor.dim() > 1 and tensor.shape[1] < widest:
        gap = widest - tensor.shape[1]
        spec = [0, 0] * (tensor.dim() - 2) + ([gap, 0] if left else [0, gap])
        padded = F.pad(tensor, spec, value=pad_value)
    # all_gather needs equal shapes: rows padded to the largest share, cut off again below
    padded = F.pad(padded, [0, 0] * (padded.dim() - 1) + [0, most - padded.shape[0]]).to(collective_device())
    pieces = [torch.empty_like(padded) for _ in shapes]
    dist.all_gather(pieces, padded.contiguous(), group=current_group())
    return torch.cat([piece[: shape[0]] for piece, shape in zip(pieces, shapes)]).to(tensor.device)


def gather_rollouts(rollouts: Rollouts, pad_id: int) -> Rollouts:
    """Every rank's share of a step's rollouts as one Rollouts of the whole batch. Sampler statistics are
    averaged over ranks (a maximum or peak: the largest), as each covers an equal share of rows."""
    if not active():
        return rollouts
    texts = [text for share in gather_objects(rollouts.texts) for text in share]
    metrics = gather_objects(rollouts.metrics)
    # bool tensors travel as uint8 (NCCL has no bool)
    return replace(
        rollouts,
        prompt_ids=gather_rows(rollouts.prompt_ids, pad_id, left=True),
        prompt_mask=gather_rows(rollouts.prompt_mask.to(torch.uint8), left=True).bool(),
        completion_ids=gather_rows(rollouts.completion_ids, pad_id),
        completion_mask=gather_rows(rollouts.completion_mask.to(torch.uint8)).bool(),
        logprobs=gather_rows(rollouts.logprobs),
        texts=texts,
        hit_max_tokens=gather_rows(rollouts.hit_max_tokens.to(torch.uint8)).bool(),
        entropies=None if rollouts.entropies is None else gather_rows(rollouts.entropies),
        sampled_mask=None
        if rollouts.sampled_mask is None
        else gather_rows(rollouts.sampled_mask.to(torch.uint8)).bool(),
        metrics=combined_metrics(metrics),
    )


def combined_metrics(metrics: list[dict[str, float]]) -> dict[str, float]:
    """Sampler statistics of equal shares of a batch as one: the mean, or for a maximum or peak the largest."""
    keys = set().union(*metrics)
    out = {}
    for key in sorted(keys):
        values = [m[key] for m in metrics if key in m]
        out[key] = max(values) if ("max" in key or "peak" in key) else sum(values) / len(values)
    return out
