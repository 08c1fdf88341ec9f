"""Per-token policy losses: one function per objective, each as its paper defines it (docs/loss.md).

Every objective maps the trainer's new log-probs, the sampler's (old) log-probs and the advantages of one
micro-batch to a [R, T] token loss; rows are never split across micro-batches, so a sequence-level ratio
(GSPO) sees its whole row. `mask` marks the trained tokens: a sequence's ratio averages over those only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from retrain.backend.settings import LossSettings


@dataclass
class TokenLoss:
    """Per-token policy loss of one micro-batch, with what the metrics need."""

    loss: torch.Tensor  # [R, T] differentiable
    ratio: torch.Tensor  # [R, T] detached: the importance ratio the objective uses (GSPO: its row's s_i)
    token_ratio: torch.Tensor  # [R, T] detached: exp(new − old) per token
    clipped: torch.Tensor  # [R, T] bool: the clipped branch was taken (CISPO: the weight was clipped)
    kl: torch.Tensor | None = None  # [R, T] detached k3 to the base model, when training.kl_coef > 0
    entropy: torch.Tensor | None = None  # [R, T] detached entropy per token, when training.entropy_coef > 0


def policy_token_loss(
    new_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    settings: LossSettings,
    base_logprobs: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> TokenLoss:
    """The objective `settings.objective` per token; with kl_coef > 0 (and the base model's log-probs) plus
    kl_coef·k3 (`k3_kl`); with entropy_coef > 0 (and the entropy) minus entropy_coef·H."""
    token_ratio = torch.exp(new_logprobs - old_logprobs)
    if settings.objective == "cispo":
        loss, clipped = cispo_loss(new_logprobs, token_ratio, advantages, settings)
        ratio = token_ratio
    else:
        if settings.objective == "ppo":
            ratio = token_ratio
        else:
            ratio = sequence_ratio(new_logprobs, old_logprobs, _mask_for(mask, new_logprobs), settings.objective)
        loss, clipped = clipped_surrogate(ratio, advantages, settings)
    kl = None
    if settings.kl_coef != 0 and base_logprobs is not None:
        kl = k3_kl(new_logprobs, base_logprobs)
        loss = loss + settings.kl_coef * kl
    if settings.entropy_coef != 0 and entropy is not None:
        loss = loss - settings.entropy_coef * entropy
    return TokenLoss(
        loss=loss,
        ratio=ratio.detach(),
        token_ratio=token_ratio.detach(),
        clipped=clipped,
        kl=None if kl is None else kl.detach(),
        entropy=None if entropy is None or settings.entropy_coef == 0 else entropy.detach(),
    )


def clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, settings: LossSettings
) -> tuple[torch.Tensor, torch.Tensor]:
    """−ratio·A, or with clip_eps > 0 the pessimistic −min(ratio·A, clip(ratio, 1−ε, 1+ε_high)·A) (PPO, DAPO,
    GSPO); and where the clipped branch was taken."""
    unclipped = ratio * advantages
    if not settings.clipped:
        return -unclipped, torch.zeros_like(ratio, dtype=torch.bool)
    bounded = ratio.clamp(1.0 - settings.clip_eps, 1.0 + settings.upper_eps) * advantages
    return -torch.minimum(unclipped, bounded), (bounded < unclipped).detach()


def sequence_ratio(new: torch.Tensor, old: torch.Tensor, mask: torch.Tensor, objective: str) -> torch.Tensor:
    """GSPO's s_i = exp(mean over the row's trained tokens of (new − old)), broadcast over its tokens; for
    `gspo_token`, s_i,t = sg[s_i]·π(y_t)/sg[π(y_t)]: the value s_i, the gradient of each token's own log-prob."""
    counts = mask.sum(dim=1, keepdim=True).clamp(min=1)
    log_s = ((new - old) * mask).sum(dim=1, keepdim=True) / counts
    if objective == "gspo":
        return torch.exp(log_s).expand_as(new)
    return torch.exp(log_s.detach() + new - new.detach())


def cispo_loss(
    new_logprobs: torch.Tensor, ratio: torch.Tensor, advantages: torch.Tensor, settings: LossSettings
) -> tuple[torch.Tensor, torch.Tensor]:
    """MiniMax-M1's CISPO: −sg[clip(r, 1−ε_low, 1+ε_high)]·A·log π on every token (no token's gradient is
    dropped, only its weight bounded); and where the weight was clipped."""
    weight = ratio.detach().clamp(1.0 - settings.clip_eps, 1.0 + settings.upper_eps)
    return -weight * advantages * new_logprobs, (weight != ratio.detach())


def k3_kl(logprobs: torch.Tensor, base_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(policy ‖ base) on tokens sampled from the policy:
    exp(base − logp) − (base − logp) − 1, never negative, 0 where the two agree, unbiased in expectation."""
    log_ratio = base_logprobs - logprobs
    return torch.exp(log_ratio) - log_ratio - 1


def _mask_for(mask: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """The trained tokens; without a mask, every token."""
    return torch.ones_like(like) if mask is None else mask.to(like.dtype)
