"""Algorithm plugins as a researcher would write them, plugged in by `_target_` (and a few broken ones).

Each kind: an episode advantage, an uncertainty kind, a token transform, a whole algorithm.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from retrain.algorithm.base import AdvantageOutput
from retrain.algorithm.pipeline import Algorithm
from retrain.algorithm.tokens import TokenBatch

# ---- episode advantages: (rewards [B, G]) -> [B, G] ------------------------------------------------


def sign_advantage(rewards: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """+scale above the group mean, -scale below it: only the ranking counts, not the margin."""
    return scale * torch.sign(rewards - rewards.mean(dim=1, keepdim=True))


class ScaledGRPO:
    """A class-based advantage: built once with its parameters, called every step."""

    batch_normalized = False

    def __init__(self, scale: float) -> None:
        self.scale = scale

    def __call__(self, rewards: torch.Tensor) -> torch.Tensor:
        return self.scale * (rewards - rewards.mean(dim=1, keepdim=True))


def wrong_shape_advantage(rewards: torch.Tensor) -> torch.Tensor:
    """Bug: one number per group instead of per completion."""
    return rewards.mean(dim=1)


def nan_advantage(rewards: torch.Tensor) -> torch.Tensor:
    """Bug: divides by the group's spread, which is 0 for a uniform group."""
    spread = rewards.max(dim=1, keepdim=True).values - rewards.min(dim=1, keepdim=True).values
    return (rewards - rewards.mean(dim=1, keepdim=True)) / spread * 0.0 / 0.0


def float64_overflow_advantage(rewards: torch.Tensor) -> torch.Tensor:
    """Bug: finite in float64 (1e300), inf once the pipeline computes in float32."""
    return (rewards - rewards.mean(dim=1, keepdim=True)).double() * 1e300


# ---- uncertainty kinds: (logprobs, mask, entropies | None) -> [N, T] -------------------------------


def miss_probability(logprobs: torch.Tensor, mask: torch.Tensor, entropies: torch.Tensor | None) -> torch.Tensor:
    """1 - p of the sampled token: how likely the sampler was to pick something else."""
    return 1.0 - logprobs.exp()


miss_probability.metric_prefix = "miss"  # type: ignore[attr-defined]


def entropy_gap(logprobs: torch.Tensor, mask: torch.Tensor, entropies: torch.Tensor | None) -> torch.Tensor:
    """Surprisal minus the distribution's entropy: needs entropies from the engine."""
    assert entropies is not None
    return (-logprobs - entropies).abs()


entropy_gap.needs_entropies = True  # type: ignore[attr-defined]


def surprisal_in_bits_squared(
    logprobs: torch.Tensor, mask: torch.Tensor, entropies: torch.Tensor | None
) -> torch.Tensor:
    """(-log2 p)^2: grows past the 50.0 cap for unlikely tokens."""
    return (-logprobs / 0.6931471805599453) ** 2


def nan_uncertainty(logprobs: torch.Tensor, mask: torch.Tensor, entropies: torch.Tensor | None) -> torch.Tensor:
    """Bug: log of a probability that can be 1 gives -inf, times 0 gives NaN."""
    return torch.log1p(-logprobs.exp()) * 0.0 / 0.0


# ---- token transforms: (TokenBatch) -> TokenBatch -------------------------------------------------


class ClipAdvantages:
    """Keep every token advantage within [-limit, limit] (uniform rows stay uniform)."""

    token_varying = False

    def __init__(self, limit: float = 0.5) -> None:
        self.limit = limit

    def __call__(self, batch: TokenBatch) -> TokenBatch:
        clipped = batch.advantages.clamp(-self.limit, self.limit)
        return replace(batch, advantages=clipped).with_metrics(clip_limit=self.limit)


def boost_opening(batch: TokenBatch, tokens: int = 4, factor: float = 2.0) -> TokenBatch:
    """Multiply the first `tokens` tokens' advantages by `factor` (declares nothing: conservative)."""
    boost = torch.ones_like(batch.advantages)
    boost[:, :tokens] = factor
    return replace(batch, advantages=batch.advantages * boost)


class DropLastToken:
    """Bug: returns one token fewer than it was given."""

    def __call__(self, batch: TokenBatch) -> TokenBatch:
        return replace(batch, advantages=batch.advantages[:, :-1])


class InfiniteUncertainty:
    """Bug: rewrites the uncertainty with an overflow."""

    token_varying = False

    def __call__(self, batch: TokenBatch) -> TokenBatch:
        return replace(batch, uncertainty=batch.uncertainty * float("inf"))


# ---- whole algorithms ------------------------------------------------------------------------------


class RankAlgorithm:
    """A whole algorithm written from scratch: each completion's advantage is its centred rank in its
    group, the same on all its tokens. Accepts (and ignores) the rest of the composed config."""

    token_varying = False
    needs_planning = False
    needs_entropies = False

    def __init__(self, name: str, label: str, **config: Any) -> None:
        self.name, self.label = name, label
        self.steps_done = 0

    def begin_step(self, step: int) -> dict[str, float]:
        return {}

    def planning_mask(
        self, completion_ids: torch.Tensor, completion_mask: torch.Tensor, tokenizer: Any
    ) -> torch.Tensor:
        raise NotImplementedError("RankAlgorithm needs no planning mask")

    def ranks(self, rewards: torch.Tensor) -> torch.Tensor:
        order = rewards.argsort(dim=1).argsort(dim=1).float()
        return order - order.mean(dim=1, keepdim=True)

    def compute(
        self,
        rewards: torch.Tensor,
        logprobs: torch.Tensor,
        mask: torch.Tensor,
        entropies: torch.Tensor | None,
        planning: torch.Tensor | None,
    ) -> AdvantageOutput:
        per_row = self.ranks(rewards).reshape(-1, 1)
        return AdvantageOutput(
            token_advantages=per_row * mask,
            group_has_signal=torch.ones(rewards.shape[0], dtype=torch.bool),
            metrics={"rank_steps": float(self.steps_done)},
        )

    def end_step(self, correct_rate: float) -> None:
        self.steps_done += 1

    def state_dict(self) -> dict[str, Any]:
        return {"steps_done": self.steps_done}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps_done = int(state["steps_done"])


class FlatShapeAlgorithm(RankAlgorithm):
    """Bug: returns one advantage per completion ([N]) instead of per token ([N, T])."""

    def compute(self, rewards, logprobs, mask, entropies, planning):  # type: ignore[override]
        output = super().compute(rewards, logprobs, mask, entropies, planning)
        return replace(output, token_advantages=output.token_advantages[:, 0])


class UndeclaredVaryingAlgorithm(RankAlgorithm):
    """Declares token-uniform advantages but decays them along the sequence."""

    def compute(self, rewards, logprobs, mask, entropies, planning):  # type: ignore[override]
        output = super().compute(rewards, logprobs, mask, entropies, planning)
        decay = 0.9 ** torch.arange(mask.shape[1], dtype=torch.float32)
        return replace(output, token_advantages=output.token_advantages * decay)


class SubclassedPipeline(Algorithm):
    """Keeps the built-in pipeline but overrides `compute`, with a bug: one advantage per completion."""

    def compute(self, rewards, logprobs, mask, entropies=None, planning=None):  # type: ignore[override]
        output = super().compute(rewards, logprobs, mask, entropies, planning)
        return replace(output, token_advantages=output.token_advantages[:, 0])


def failing_advantage(rewards: torch.Tensor) -> torch.Tensor:
    """Bug: indexes a column the rewards do not have."""
    raise IndexError("index 9 is out of bounds for dimension 1")


class FailingTransform:
    """A token transform whose own helper raises (a plugin's bug, not retrain's)."""

    def __call__(self, batch: TokenBatch) -> TokenBatch:
        raise KeyError("planning")
