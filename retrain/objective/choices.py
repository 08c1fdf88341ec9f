"""The objectives (`training.objective`) and their papers' defaults, and the loss aggregations
(`training.loss_agg`, retrain/objective/aggregation.py). The objective's defaults apply where `training.clip_eps`,
`clip_eps_high` or `loss_agg` is left null (docs/loss.md)."""

from __future__ import annotations

from typing import NamedTuple

LOSS_AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_sum_norm")
LR_SCHEDULES = ("constant", "linear", "cosine")
MISMATCH_MODES = ("none", "tis", "mask")  # training.mismatch_mode (retrain/objective/mismatch.py)
MISMATCH_LEVELS = ("token", "sequence")


class ObjectiveDefaults(NamedTuple):
    clip_eps: float  # ε (ε_low): the lower bound is 1 − ε
    clip_eps_high: float | None  # ε_high; None: ε
    loss_agg: str


OBJECTIVES: dict[str, ObjectiveDefaults] = {
    # today's: pure importance sampling −r·A unless clip_eps > 0 (PPO; DAPO with clip_eps_high)
    "ppo": ObjectiveDefaults(0.0, None, "token_mean"),
    # Zheng et al. 2025 (GSPO): ε 3e-4 left, 4e-4 right; 1/G Σ_i of a sequence-level term (1/|y_i| Σ_t for -token)
    "gspo": ObjectiveDefaults(3e-4, 4e-4, "seq_mean_token_mean"),
    "gspo_token": ObjectiveDefaults(3e-4, 4e-4, "seq_mean_token_mean"),
    # MiniMax-M1 (CISPO): no lower bound (ε_low = 1: the weight's floor 0 never binds), ε_high tuned (the paper
    # gives no value; 0.28 is DAPO's and verl's/Trinity-RFT's default); normalised by the batch's total tokens
    "cispo": ObjectiveDefaults(1.0, 0.28, "token_mean"),
}
