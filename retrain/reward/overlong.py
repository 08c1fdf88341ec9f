"""DAPO's soft overlong punishment (Yu et al. 2025, eq. 13): a length penalty added to the reward before advantages.

A completion that runs into the last `buffer` tokens of the budget L_max is penalised linearly, from 0 at
L_max − buffer to −1 at L_max, so the policy learns to finish before it is truncated instead of every truncated
completion scoring like a wrong answer. Done on the trainer's side, from the completions' lengths alone, so it
works the same for every backend and inference engine (docs/rewards.md).
"""

from __future__ import annotations

import torch


def overlong_buffer(max_tokens: int, fraction: float) -> int:
    """L_cache in tokens: `fraction` of max_tokens, rounded, at least 1 when on (the paper's 4096 of 20480 is 0.2),
    so one recipe fits any max_tokens."""
    return max(1, round(fraction * max_tokens)) if fraction > 0 else 0


def overlong_penalty(lengths: torch.Tensor, max_tokens: int, buffer: int, factor: float) -> torch.Tensor:
    """R_length per completion (float32, same shape as `lengths`), times `factor`: 0 up to L_max − buffer,
    ((L_max − buffer) − |y|) / buffer inside the buffer, −1 beyond L_max (not reachable when max_tokens caps
    sampling). `buffer` 0: no shaping, all zeros."""
    lengths = lengths.to(torch.float32)
    if buffer <= 0:
        return torch.zeros_like(lengths)
    start = max_tokens - buffer
    inside = (start - lengths) / buffer
    shaped = torch.where(lengths <= start, torch.zeros_like(lengths), inside)
    return factor * torch.where(lengths > max_tokens, torch.full_like(lengths, -1.0), shaped)


def shape_rewards(
    rewards: torch.Tensor, lengths: torch.Tensor, excluded: torch.Tensor, max_tokens: int, buffer: int, factor: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """(rewards [B, G] plus the overlong penalty, {reward/overlong_penalty_mean}); rows the reward gave no verdict
    (`excluded`) keep their filled value, so they stay out of every statistic. `buffer` 0: unchanged, no metric."""
    if buffer <= 0:
        return rewards, {}
    penalty = overlong_penalty(lengths, max_tokens, buffer, factor).view_as(rewards).masked_fill(excluded, 0.0)
    judged = int((~excluded).sum())
    return rewards + penalty, {"reward/overlong_penalty_mean": float(penalty.sum()) / max(judged, 1)}
