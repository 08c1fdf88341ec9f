"""Token-level transforms: SEPA pooling, GTPO weighting, HICRA, the surprisal mask.

A transform is a callable `(TokenBatch) -> TokenBatch`; it may declare `needs_planning`,
`token_varying` (whether it makes advantages differ across a completion's tokens) and
`uses_sepa_lambda`. All of them work on the whole step at once through masked row reductions.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from retrain.algorithm.checks import require
from retrain.algorithm.config import GTPOConfig, HICRAConfig
from retrain.algorithm.tokens import TokenBatch, capped
from retrain.plugins import built_in

GTPO_FLAT_MEAN = 1e-7  # a completion whose mean uncertainty is below this keeps A_i on every token
GTPO_EPS = 1e-8


def _execution_means(
    u: torch.Tensor, lengths: torch.Tensor, planning_weights: torch.Tensor, planning_lengths: torch.Tensor
) -> torch.Tensor:
    """Per-completion mean of `u` over execution tokens [N, 1] (0 for a completion without any)."""
    total = u.sum(dim=1, keepdim=True) - torch.linalg.vecdot(u, planning_weights, dim=1).unsqueeze(1)
    return total / (lengths - planning_lengths).clamp_min(1.0)


@built_in
class SEPAPooling:
    """SEPA: pull each completion's execution-token uncertainty towards its mean by lambda.

    u <- lambda * mu + (1 - lambda) * u on execution tokens; planning tokens keep theirs, so GTPO's
    differentiation concentrates on them as lambda grows.
    """

    needs_planning = True
    token_varying = False  # rewrites uncertainty, not advantages
    uses_sepa_lambda = True

    def __call__(self, batch: TokenBatch) -> TokenBatch:
        lam = min(max(batch.sepa_lambda, 0.0), 1.0)
        if lam == 0.0:
            return batch
        u = capped(batch.uncertainty)
        planning_weights, planning_lengths = batch.require_planning("SEPA pooling")
        mean = _execution_means(u, batch.real_lengths, planning_weights, planning_lengths)
        # lerp is exact at both ends: weight 0 keeps u (planning, padding), weight 1 gives mu
        weight = torch.sub(batch.real_weights, planning_weights).mul_(lam)
        return replace(batch, uncertainty=torch.lerp(u, mean.expand_as(u), weight))


@built_in
class SEPAAmplification:
    """The SEPA variants `sepa_amp` / `sepa_amp_c`: push execution tokens away from their mean.

    u <- (1 + lambda) * u - lambda * mu on execution tokens, floored at 0 when `floor_at_zero`.
    """

    needs_planning = True
    token_varying = False
    uses_sepa_lambda = True

    def __init__(self, floor_at_zero: bool = False) -> None:
        self.floor_at_zero = floor_at_zero

    def __call__(self, batch: TokenBatch) -> TokenBatch:
        lam = min(max(batch.sepa_lambda, 0.0), 1.0)
        if lam == 0.0:
            return batch
        u = capped(batch.uncertainty)
        planning_weights, planning_lengths = batch.require_planning("SEPA amplification")
        mean = _execution_means(u, batch.real_lengths, planning_weights, planning_lengths)
        amplified = (1.0 + lam) * u - lam * mean
        if self.floor_at_zero:
            amplified = amplified.clamp_min(0.0)
        return replace(batch, uncertainty=torch.where(batch.execution_mask(), amplified, u))


@built_in
class GTPOWeighting:
    """GTPO: weigh each token's advantage by its uncertainty relative to its completion's mean.

    w_t = max(0, 1 + beta * (u_t / (mean + 1e-8) - 1)); a flat completion (mean < 1e-7) or beta = 0
    keeps its advantage on every token.
    """

    needs_planning = False
    token_varying = True
    uses_sepa_lambda = False

    def __init__(self, beta: float = GTPOConfig.beta) -> None:
        require(math.isfinite(beta), f"algorithm.gtpo.beta={beta} must be a finite number")
        self.beta = beta

    def __call__(self, batch: TokenBatch) -> TokenBatch:
        if self.beta == 0.0:
            return batch
        u = capped(batch.uncertainty)
        mean = u.sum(dim=1, keepdim=True) / batch.real_lengths.clamp_min(1.0)  # u is 0 on padding
        flat = mean < GTPO_FLAT_MEAN
        # 1 + beta * (u / m - 1) == u * (beta / m) + (1 - beta): two tensor ops instead of four
        scale = torch.where(flat, 0.0, self.beta / (mean + GTPO_EPS))
        offset = torch.where(flat, 1.0, 1.0 - self.beta)
        weights = torch.addcmul(offset, u, scale)
        if not 0.0 <= self.beta <= 1.0 or float(u.min()) < 0.0:  # else every weight is >= 1 - beta >= 0
            weights.clamp_min_(0.0)
        return replace(batch, advantages=weights.mul_(batch.advantages))


@built_in
class HICRA:
    """HICRA: amplify planning tokens' advantages, A <- A + alpha * |A| on planning tokens.

    alpha in [0, 1] so that a negative advantage shrinks towards 0 but never flips sign.
    """

    needs_planning = True
    token_varying = True
    uses_sepa_lambda = False

    def __init__(self, alpha: float = HICRAConfig.alpha) -> None:
        require(
            0.0 <= alpha <= 1.0,
            f"algorithm.hicra.alpha={alpha} must be in [0, 1] (above 1 it would flip "
            "the sign of negative planning-token advantages)",
        )
        self.alpha = alpha

    def __call__(self, batch: TokenBatch) -> TokenBatch:
        if batch.planning is None:
            raise ValueError("HICRA needs the planning mask, but the step has none")
        if self.alpha == 0.0:
            return batch
        planning_weights, _ = batch.require_planning("HICRA")  # present: derived from `planning` above
        advantages = batch.advantages
        amplified = torch.addcmul(advantages, advantages.abs(), planning_weights, value=self.alpha)
        return replace(batch, advantages=amplified)


@built_in
class SurprisalMask:
    """Top-rho mask (Yue et al.): per group, only the most uncertain tokens keep their advantage.

    Over all real tokens of a group, with the raw (un-pooled) uncertainty, the threshold is the value
    at index max(1, floor(n * rho)) - 1 in descending order; tokens below it get 0 (ties are kept).
    """

    needs_planning = False
    token_varying = True
    uses_sepa_lambda = False

    def __init__(self, rho: float) -> None:
        require(
            rho > 0.0 and math.isfinite(rho), f"algorithm.surprisal_mask_rho={rho} must be > 0 (0 disables the mask)"
        )
        self.rho = rho

    def __call__(self, batch: TokenBatch) -> TokenBatch:
        groups, width = batch.num_groups, batch.group_size * batch.mask.shape[1]
        real = batch.mask.reshape(groups, width)
        raw = batch.raw_uncertainty.reshape(groups, width)
        count = real.sum(dim=1)
        kth = (count.double() * self.rho).floor().long().clamp_min(1).minimum(count.clamp_min(1))
        ranked = raw.masked_fill(~real, -math.inf).topk(int(kth.max()), dim=1).values
        threshold = ranked.gather(1, (kth - 1).unsqueeze(1))
        keep = ((raw >= threshold) & real).reshape(batch.mask.shape)
        masked = int(count.sum()) - int(keep.sum())
        has_tokens = count > 0
        mean_threshold = float(threshold[has_tokens].mean()) if bool(has_tokens.any()) else 0.0
        return replace(batch, advantages=torch.where(keep, batch.advantages, 0.0)).with_metrics(
            surprisal_mask_threshold=mean_threshold,
            surprisal_mask_fraction=masked / max(int(count.sum()), 1),
        )
