"""How a step's token losses become one loss: `training.loss_agg` (docs/loss.md).

Every mode is L = Σ_tokens w_t·ℓ_t / D, with a per-token weight w (0 off the trained tokens) and one
divisor D for the whole step. Rows are never split across micro-batches, so a row's weight is known
locally; D is counted over every rank before any micro-batch runs. Each micro-batch backpropagates its
Σ w·ℓ / D, so the accumulated gradient is that of L however rows are split into micro-batches or ranks.

| mode | w_t | D |
| token_mean | 1 | trained tokens of the step |
| seq_mean_token_mean | 1 / the row's trained tokens | rows with a trained token |
| seq_mean_token_sum | 1 | rows with a trained token |
| seq_sum_norm | 1 | a constant (Dr. GRPO): loss_agg_constant, else B·G·max_tokens |
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from retrain.objective.choices import LOSS_AGGREGATIONS


@dataclass(frozen=True)
class Aggregation:
    """L = Σ weights·ℓ / divisor over the step (see the module docstring)."""

    weights: torch.Tensor  # [R, T] float: 0 off the trained tokens
    divisor: float


def aggregation(
    mode: str, trained: torch.Tensor, constant: float, total: Callable[[torch.Tensor], torch.Tensor]
) -> Aggregation:
    """The weights and divisor of `mode` for this rank's trained tokens `trained` ([R, T] bool); `total` sums a
    count over every rank (the data-parallel all-reduce), `constant` is seq_sum_norm's divisor."""
    weights = trained.float()
    if mode == "token_mean":
        return Aggregation(weights, float(total(trained.sum())))
    if mode == "seq_sum_norm":
        return Aggregation(weights, constant)
    per_row = trained.sum(dim=1, keepdim=True)
    rows = float(total((per_row > 0).sum()))
    if mode == "seq_mean_token_mean":
        weights = weights / per_row.clamp(min=1)
    elif mode != "seq_mean_token_sum":
        raise ValueError(f"unknown loss aggregation {mode!r}; one of {', '.join(LOSS_AGGREGATIONS)}")
    return Aggregation(weights, rows)
