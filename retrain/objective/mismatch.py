"""Sampler–trainer mismatch correction: `training.mismatch_mode` (docs/loss.md).

The sampler (vLLM, SGLang, a server in bf16) computes other log-probs than the trainer at the same weights.
With π_old the trainer's own log-probs at the rollout's weights (a no-grad forward before the batch's first
update), each trained token's loss is multiplied by a detached factor from w = π_old / π_sampler:
tis (Yao et al. 2025, truncated importance sampling) min(w, C); mask (IcePop) 1 where lower <= w <= upper,
else 0 (the token leaves the loss; the divisor is unchanged). At level `sequence` one w per row: the product
of its trained tokens' ratios.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from retrain.backend.settings import LossSettings
from retrain.objective.policy import k3_kl

LOG_RATIO_BOUND = 50.0  # |log w| beyond this is reported as this (a sequence's product can overflow fp32)


def log_weights(sampler: torch.Tensor, trainer: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """[R, T] log w = log π_trainer − log π_sampler on the trained tokens `mask` (0 elsewhere); at level
    `sequence` each row's sum over its trained tokens, broadcast over the row."""
    log_w = (trainer - sampler) * mask
    if level == "sequence":
        log_w = log_w.sum(dim=1, keepdim=True).expand_as(log_w) * mask
    return log_w


def correction(log_w: torch.Tensor, settings: LossSettings) -> torch.Tensor:
    """[R, T] detached factor of each token's loss: min(w, cap) (tis), 1[lower <= w <= upper] (mask), 1 (none)."""
    if settings.mismatch_mode == "tis":
        return torch.exp(log_w.clamp(max=math.log(settings.mismatch_cap)))
    if settings.mismatch_mode == "mask":
        return _kept(log_w, settings).to(log_w.dtype)
    return torch.ones_like(log_w)


@dataclass(frozen=True)
class MismatchSums:
    """This rank's sums over its trained tokens, all-reduced by the backend into `mismatch/*` metrics."""

    kl: float  # Σ k3 KL(π_sampler ‖ π_trainer) per token
    log_gap: float  # Σ (log π_sampler − log π_trainer)
    ratio: float  # Σ w
    ratio_min: float
    ratio_max: float
    truncated: float  # tokens whose w > cap (tis)
    masked: float  # tokens dropped (mask)


def mismatch_sums(
    sampler: torch.Tensor, trainer: torch.Tensor, mask: torch.Tensor, settings: LossSettings
) -> MismatchSums:
    """The sums of `MismatchSums` over the trained tokens `mask` ([R, T] bool)."""
    log_w = log_weights(sampler, trainer, mask, settings.mismatch_level)[mask].clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    ratio = torch.exp(log_w.double())
    if not len(ratio):
        return MismatchSums(0.0, 0.0, 0.0, math.inf, -math.inf, 0.0, 0.0)
    truncated = float((log_w > math.log(settings.mismatch_cap)).sum()) if settings.mismatch_mode == "tis" else 0.0
    masked = float((~_kept(log_w, settings)).sum()) if settings.mismatch_mode == "mask" else 0.0
    return MismatchSums(
        kl=float(k3_kl(sampler[mask].double(), trainer[mask].double()).sum()),
        log_gap=float((sampler[mask] - trainer[mask]).double().sum()),
        ratio=float(ratio.sum()),
        ratio_min=float(ratio.min()),
        ratio_max=float(ratio.max()),
        truncated=truncated,
        masked=masked,
    )


def _kept(log_w: torch.Tensor, settings: LossSettings) -> torch.Tensor:
    """Where w lies in [lower, upper]."""
    lower = math.log(settings.mismatch_lower) if settings.mismatch_lower > 0 else -math.inf
    return (log_w >= lower) & (log_w <= math.log(settings.mismatch_upper))
