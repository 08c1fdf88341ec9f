"""Batch-level steps, after every group is done: normalisation and the advantage cap.

Both act only on nonzero token advantages (a zero means "leave this token out of the loss": a
masked token, a dropped group) and are transforms like any other: `(TokenBatch) -> TokenBatch`.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from retrain.algorithm.checks import require
from retrain.algorithm.tokens import TokenBatch, block_squares, block_sum
from retrain.plugins import built_in

NORM_EPS = 1e-8


def nonzero_stats(advantages: torch.Tensor) -> tuple[float, float, int]:
    """Token-weighted mean, population std and count of the nonzero advantages (one pass, for metrics)."""
    count = int(torch.count_nonzero(advantages))
    if count == 0:
        return 0.0, 0.0, 0
    mean = block_sum(advantages) / count
    return mean, math.sqrt(max(block_squares(advantages) / count - mean * mean, 0.0)), count


def stats_metrics(mean: float, std: float, count: int) -> dict[str, float]:
    return {"batch_adv_mean": mean, "batch_adv_std": std, "batch_adv_count": float(count)}


@built_in
class BatchNormalization:
    """(a - mu) / (sigma + 1e-8) over every nonzero token advantage of the step; zeros stay zero.

    With sigma < 1e-8 the entries are only centred. Reports the step's pre-normalisation stats.
    """

    needs_planning = False
    token_varying = False
    uses_sepa_lambda = False

    def __call__(self, batch: TokenBatch) -> TokenBatch:
        nonzero = batch.advantages != 0
        count = int(torch.count_nonzero(nonzero))
        if count == 0:
            return batch.with_metrics(**stats_metrics(0.0, 0.0, 0))
        mean = block_sum(batch.advantages) / count
        centred = torch.where(nonzero, batch.advantages - mean, 0.0)  # two passes: exact for equal values
        std = math.sqrt(block_squares(centred) / count)
        normalised = centred / (std + NORM_EPS) if std >= NORM_EPS else centred
        return replace(batch, advantages=normalised).with_metrics(**stats_metrics(mean, std, count))


@built_in
class AdvantageCap:
    """Clamp nonzero token advantages to [-cap, cap]; reports the fraction that was clipped."""

    needs_planning = False
    token_varying = False
    uses_sepa_lambda = False

    def __init__(self, cap: float) -> None:
        require(cap > 0.0 and math.isfinite(cap), f"algorithm.adv_clip_max={cap} must be > 0 (0 disables the cap)")
        self.cap = cap

    def __call__(self, batch: TokenBatch) -> TokenBatch:
        advantages = batch.advantages
        clipped = int(torch.count_nonzero(advantages.abs() > self.cap))
        nonzero = int(torch.count_nonzero(advantages))
        return replace(batch, advantages=advantages.clamp(-self.cap, self.cap)).with_metrics(
            adv_cap_fraction=clipped / max(nonzero, 1)
        )
