"""The step's token-level view that transforms rewrite, and the masked reductions they share.

Every tensor is a padded [N, T] block (row n = b * group_size + g). Masks are also carried as
0/1 float weights, because on CPU float arithmetic is several times faster than bool selection;
reductions are sums over those weights, so padding never enters a result.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace

import torch

MAX_UNCERTAINTY = 50.0  # caps -log p of near-impossible tokens so one token cannot dominate a mean


@dataclass(frozen=True)
class TokenBatch:
    """What a token transform reads and returns (change fields with `dataclasses.replace`).

    `advantages` and `uncertainty` are 0 on padding. `uncertainty` is what GTPO weighs by (SEPA
    rewrites it); `raw_uncertainty` stays as the uncertainty kind produced it. The float weights and
    lengths are derived from the masks when not given (a transform that replaces `planning` passes
    `planning_weights=None, planning_lengths=None` so they are derived again).
    """

    advantages: torch.Tensor  # [N, T] float32
    uncertainty: torch.Tensor  # [N, T] float32
    raw_uncertainty: torch.Tensor  # [N, T] float32
    mask: torch.Tensor  # [N, T] bool: real completion tokens
    planning: torch.Tensor | None  # [N, T] bool planning tokens (False on padding); None: not detected
    group_size: int
    sepa_lambda: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    mask_weights: torch.Tensor | None = None  # [N, T] float32 copy of `mask`
    planning_weights: torch.Tensor | None = None  # [N, T] float32 copy of `planning`
    lengths: torch.Tensor | None = None  # [N, 1] float32 real tokens per completion
    planning_lengths: torch.Tensor | None = None  # [N, 1] float32 planning tokens per completion

    def __post_init__(self) -> None:
        fill = functools.partial(object.__setattr__, self)  # frozen: derived caches are set once, here
        mask_weights = self.mask_weights
        if mask_weights is None:
            mask_weights = as_weights(self.mask, self.advantages.dtype)
            fill("mask_weights", mask_weights)
        if self.lengths is None:
            fill("lengths", mask_weights.sum(dim=1, keepdim=True))
        planning_weights = self.planning_weights
        if self.planning is not None and planning_weights is None:
            planning_weights = as_weights(self.planning, self.advantages.dtype)
            fill("planning_weights", planning_weights)
        if planning_weights is not None and self.planning_lengths is None:
            fill("planning_lengths", planning_weights.sum(dim=1, keepdim=True))

    @property
    def num_groups(self) -> int:
        return self.mask.shape[0] // self.group_size

    def execution_mask(self) -> torch.Tensor:
        """Real tokens that are not planning tokens (all real tokens when planning is unknown)."""
        return self.mask if self.planning is None else self.mask & ~self.planning

    @property
    def real_weights(self) -> torch.Tensor:
        """`mask_weights`, which `__post_init__` always sets (the field is Optional only as an input)."""
        weights = self.mask_weights
        assert weights is not None
        return weights

    @property
    def real_lengths(self) -> torch.Tensor:
        """`lengths`, which `__post_init__` always sets (the field is Optional only as an input)."""
        lengths = self.lengths
        assert lengths is not None
        return lengths

    @property
    def planning_view(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(planning_weights, planning_lengths), or None when planning tokens were not detected."""
        weights = self.planning_weights
        if weights is None:
            return None
        lengths = self.planning_lengths
        assert lengths is not None  # `__post_init__` derives them whenever the weights are set
        return weights, lengths

    def require_planning(self, transform: str) -> tuple[torch.Tensor, torch.Tensor]:
        """`planning_view` for a transform that cannot run without it (ValueError naming `transform`)."""
        view = self.planning_view
        if view is None:
            raise ValueError(f"{transform} needs the planning mask, but the step has none")
        return view

    def execution_weights(self) -> torch.Tensor:
        weights = self.real_weights
        return weights if self.planning_weights is None else weights - self.planning_weights

    def with_metrics(self, **values: float) -> TokenBatch:
        """A copy whose metrics include `values` (transforms report through this)."""
        return replace(self, metrics={**self.metrics, **values})


def as_weights(mask: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A bool mask as 0/1 floats (through uint8: twice as fast as a bool -> float cast on CPU)."""
    return mask.view(torch.uint8).to(dtype)


@dataclass(frozen=True)
class Moments:
    """Count, mean and population variance of a set of token values."""

    count: int
    mean: float
    var: float


def split_moments(values: torch.Tensor, batch: TokenBatch) -> tuple[Moments, Moments]:
    """Moments of `values` (0 on padding) over the batch's execution and planning tokens.

    Built from row sums and norms, so the [N, T] block is read a few times and written at most
    once (this runs on every step over up to millions of tokens).
    """
    total, squares, count = block_sum(values), block_squares(values), float(batch.real_lengths.sum())
    plan_total = plan_squares = plan_count = 0.0
    planned = batch.planning_view
    if planned is not None:
        planning_weights, planning_lengths = planned
        on_plan = values * planning_weights
        plan_total, plan_squares = block_sum(on_plan), block_squares(on_plan)
        plan_count = float(planning_lengths.sum())
    return (
        _moments(count - plan_count, total - plan_total, squares - plan_squares),
        _moments(plan_count, plan_total, plan_squares),
    )


def weighted_moments(values: torch.Tensor, weights: torch.Tensor) -> Moments:
    """Moments of `values` over the tokens where the 0/1 float `weights` are 1."""
    selected = values * weights
    return _moments(block_sum(weights), block_sum(selected), block_squares(selected))


def capped(values: torch.Tensor) -> torch.Tensor:
    """`values` clamped to MAX_UNCERTAINTY, without a copy when nothing exceeds it."""
    return values.clamp_max(MAX_UNCERTAINTY) if float(values.max()) > MAX_UNCERTAINTY else values


def block_squares(values: torch.Tensor) -> float:
    """sum(values ** 2) over a [N, T] block; a norm reduction reads the block once and writes nothing."""
    return float(torch.linalg.vector_norm(values, dim=1).double().square().sum())


def block_sum(values: torch.Tensor) -> float:
    """Sum of a [N, T] block: rows in float32 (fast), rows added in float64 (accurate)."""
    return float(values.sum(dim=1).double().sum())


def _moments(count: float, total: float, squares: float) -> Moments:
    if count < 0.5:
        return Moments(0, 0.0, 0.0)
    mean = total / count
    return Moments(round(count), mean, max(squares / count - mean * mean, 0.0))
