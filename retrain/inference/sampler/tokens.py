"""The token each row takes from its next-token logits, and what the sampler records about the choice.

Log-prob semantics: the recorded log-prob of a sampled token is log_softmax(logits / T) of the full
temperature-scaled distribution, before top-p truncation — the quantity the trainer recomputes, so the
first-update importance ratio is 1. The token itself is drawn from the top-p nucleus of that distribution,
by inverse CDF with the row's own uniform (retrain/inference/sampler/counter_random.py). Temperature 0 is
greedy (argmax); its log-probs and entropies are those of the T = 1 distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from retrain.model.logprobs import scaled_log_softmax
from retrain.types import SamplingParams


@dataclass
class TokenChoice:
    """What the sampler picked at one decode step, for every row it sampled."""

    tokens: torch.Tensor  # [R] long
    logprobs: torch.Tensor  # [R] float32, from the full temperature-scaled distribution
    kept_mass: torch.Tensor  # [R] float32, probability mass of the top-p nucleus (1 without top-p)
    entropies: torch.Tensor | None  # [R] float32


def choose_tokens(
    logits: torch.Tensor, sampling: SamplingParams, uniforms: torch.Tensor | None, with_entropy: bool
) -> TokenChoice:
    """Pick one token per row from [R, V] logits: argmax at T = 0, else top-p sampling with the rows' [R]
    `uniforms` (unused, and may be None, at T = 0)."""
    logp = scaled_log_softmax(logits, sampling.temperature)
    kept_mass = torch.ones(logp.shape[0], device=logp.device)
    if sampling.temperature == 0:
        tokens = logp.argmax(dim=-1)
    else:
        if uniforms is None:
            raise ValueError("sampling at temperature > 0 needs one uniform per row")
        if sampling.top_p >= 1.0:
            tokens = draw(logp.exp(), uniforms)
        else:
            probs = logp.exp()
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            # Keep a token while the mass strictly before it is below top_p: the top token always stays.
            in_nucleus = (sorted_probs.cumsum(dim=-1) - sorted_probs) < sampling.top_p
            # The draw runs over the nucleus in vocabulary order, not sorted: near-equal probabilities swap
            # places in a sort on a rounding difference (a row decoded in another batch), which would move
            # every later token's interval of the CDF and change what a uniform picks.
            nucleus = probs * torch.zeros_like(in_nucleus).scatter_(-1, order, in_nucleus)
            kept_mass = nucleus.sum(dim=-1)
            tokens = draw(nucleus, uniforms)
    entropies = -(logp.exp() * logp).sum(dim=-1) if with_entropy else None
    return TokenChoice(
        tokens=tokens,
        logprobs=logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1),
        kept_mass=kept_mass,
        entropies=entropies,
    )


def draw(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One index per row of [R, V] non-negative `weights`, drawn with probability proportional to them by the
    row's uniform in [0, 1) ([R]).

    Inverse CDF with one uniform per row: torch.multinomial draws an exponential per entry, ~10x slower at a
    260-token vocabulary (a few % of a tiny model's step), and from a generator's shared stream. An index of
    weight 0 is never returned: should rounding in the running sum land a draw on one, the row takes its top
    weight.
    """
    cdf = weights.cumsum(dim=-1)
    target = uniforms.to(cdf.dtype).unsqueeze(-1) * cdf[:, -1:]
    drawn = torch.searchsorted(cdf, target, right=True).clamp_max_(weights.shape[-1] - 1)
    possible = weights.gather(-1, drawn).squeeze(-1) > 0
    return torch.where(possible, drawn.squeeze(-1), weights.argmax(dim=-1))
