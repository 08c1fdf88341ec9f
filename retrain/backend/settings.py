"""Typed optimiser and loss settings, built by the composition root from `training.*`.

They are plain dataclasses (not config-group schemas) because they are run-wide knobs that every
backend that trains needs, whatever `backend=` option is chosen. Their defaults live in one place,
the schema of `training.*` (retrain.config.TrainingConfig): `from_config` reads them from there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from retrain.errors import refuse_all
from retrain.objective.choices import LOSS_AGGREGATIONS, LR_SCHEDULES, MISMATCH_LEVELS, MISMATCH_MODES, OBJECTIVES

if TYPE_CHECKING:
    from retrain.config import TrainingConfig


@dataclass(frozen=True)
class OptimSettings:
    """AdamW and gradient-clipping knobs (docs/loss.md). `max_grad_norm = 0` disables clipping."""

    lr: float
    weight_decay: float
    betas: tuple[float, ...]  # two values
    eps: float
    max_grad_norm: float
    lr_schedule: str = "constant"  # constant | linear | cosine, after `warmup_steps` of linear warmup
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0  # where linear and cosine end, as a fraction of lr
    max_steps: int = 1  # the optimizer steps the schedule spans: training.max_steps × updates × mini-batches
    updates_per_batch: int = 1  # passes over each batch (training.updates_per_batch)
    mini_batches: int = 1  # optimizer steps per pass (training.mini_batches)

    @classmethod
    def from_config(cls, training: TrainingConfig) -> OptimSettings:
        return cls(
            lr=training.lr,
            weight_decay=training.weight_decay,
            betas=tuple(training.betas),
            eps=training.eps,
            max_grad_norm=training.max_grad_norm,
            lr_schedule=training.lr_schedule,
            warmup_steps=training.warmup_steps,
            min_lr_ratio=training.min_lr_ratio,
            max_steps=training.max_steps * training.updates_per_batch * training.mini_batches,
            updates_per_batch=training.updates_per_batch,
            mini_batches=training.mini_batches,
        )

    @property
    def steps_per_batch(self) -> int:
        """Optimizer steps one batch takes: each pass over it steps once per mini-batch."""
        return self.updates_per_batch * self.mini_batches

    def __post_init__(self) -> None:
        rules = {
            "lr": (self.lr > 0, "> 0"),
            "weight_decay": (self.weight_decay >= 0, ">= 0"),
            "betas": (len(self.betas) == 2 and all(0.0 <= b < 1.0 for b in self.betas), "two values in [0, 1)"),
            "eps": (self.eps > 0, "> 0"),
            "max_grad_norm": (self.max_grad_norm >= 0, ">= 0 (0 disables)"),
            "lr_schedule": (self.lr_schedule in LR_SCHEDULES, f"one of: {', '.join(LR_SCHEDULES)}"),
            "warmup_steps": (self.warmup_steps >= 0, ">= 0"),
            "min_lr_ratio": (0.0 <= self.min_lr_ratio <= 1.0, "in [0, 1]"),
            "updates_per_batch": (self.updates_per_batch >= 1, ">= 1"),
            "mini_batches": (self.mini_batches >= 1, ">= 1"),
        }
        refuse_all(
            [f"training.{key} must be {rule}, got {getattr(self, key)}" for key, (ok, rule) in rules.items() if not ok]
        )
        object.__setattr__(self, "betas", (float(self.betas[0]), float(self.betas[1])))


@dataclass(frozen=True)
class LossSettings:
    """The objective's knobs (docs/loss.md). `objective` picks the per-token loss (ppo: −ratio·A, clipped when
    clip_eps > 0; gspo, gspo_token, cispo); `clip_eps_high` None or 0 means "same as clip_eps" (set it larger
    for DAPO-style clip-higher). `loss_agg` aggregates token losses (seq_sum_norm divides by
    `loss_agg_constant`). `kl_coef > 0` adds kl_coef·k3 against the base model, `entropy_coef > 0` subtracts
    entropy_coef·H; 0 leaves the loss as it is. `from_config` fills what `training.*` leaves null with the
    objective's paper defaults (retrain/objective/choices.py)."""

    clip_eps: float
    clip_eps_high: float | None
    kl_coef: float = 0.0
    objective: str = "ppo"
    loss_agg: str = "token_mean"
    loss_agg_constant: float = 0.0  # seq_sum_norm's divisor (0: none set, for the other aggregations)
    entropy_coef: float = 0.0
    mismatch_mode: str = "none"  # none | tis | mask (retrain/objective/mismatch.py)
    mismatch_level: str = "token"
    mismatch_cap: float = 2.0
    mismatch_lower: float = 0.5
    mismatch_upper: float = 5.0

    @classmethod
    def from_config(cls, training: TrainingConfig, sampler_is_trainer: bool = True) -> LossSettings:
        """`sampler_is_trainer`: the engine samples with the trainer's own model and weights (inference=pytorch,
        training.max_staleness 0), so a null `training.mismatch_mode` is none; any other engine (vLLM, SGLang, a
        server), or sampling ahead, gets tis (docs/loss.md, docs/async.md)."""
        paper = OBJECTIVES.get(training.objective, OBJECTIVES["ppo"])  # an unknown one is refused below
        clip_eps = paper.clip_eps if training.clip_eps is None else training.clip_eps
        clip_eps_high = training.clip_eps_high
        if training.clip_eps is None and clip_eps_high is None:  # both left to the paper
            clip_eps_high = paper.clip_eps_high
        constant = training.loss_agg_constant
        return cls(
            clip_eps=clip_eps,
            clip_eps_high=clip_eps_high,
            kl_coef=training.kl_coef,
            objective=training.objective,
            loss_agg=training.loss_agg or paper.loss_agg,
            loss_agg_constant=(
                training.batch_size * training.group_size * training.max_tokens if constant is None else constant
            ),
            entropy_coef=training.entropy_coef,
            mismatch_mode=training.mismatch_mode or ("none" if sampler_is_trainer else "tis"),
            mismatch_level=training.mismatch_level,
            mismatch_cap=training.mismatch_cap,
            mismatch_lower=training.mismatch_lower,
            mismatch_upper=training.mismatch_upper,
        )

    def __post_init__(self) -> None:
        problems = [
            f"training.{key} must be >= 0 (0 = no {term} term), got {value}"
            for key, term, value in (("kl_coef", "KL", self.kl_coef), ("entropy_coef", "entropy", self.entropy_coef))
            if not value >= 0  # also refuses nan
        ] + [
            f"training.{key} must be >= 0, got {value}"
            for key, value in (("clip_eps", self.clip_eps), ("clip_eps_high", self.clip_eps_high))
            if value is not None and value < 0
        ]
        if self.objective == "ppo" and self.clip_eps == 0 and self.clip_eps_high:
            problems.append(
                f"training.clip_eps_high={self.clip_eps_high} needs training.clip_eps > 0 "
                "(clip_eps = 0 selects the unclipped importance-sampling loss)"
            )
        if self.objective not in OBJECTIVES:
            problems.append(f"training.objective={self.objective!r} is not one of: {', '.join(OBJECTIVES)}")
        if self.loss_agg not in LOSS_AGGREGATIONS:
            problems.append(f"training.loss_agg={self.loss_agg!r} is not one of: {', '.join(LOSS_AGGREGATIONS)}")
        if not (self.loss_agg_constant > 0 or (self.loss_agg_constant == 0 and self.loss_agg != "seq_sum_norm")):
            problems.append(
                f"training.loss_agg_constant must be > 0 (null = batch_size·group_size·max_tokens), "
                f"got {self.loss_agg_constant}"
            )
        problems += self._mismatch_problems()
        refuse_all(problems)

    def _mismatch_problems(self) -> list[str]:
        problems = []
        if self.mismatch_mode not in MISMATCH_MODES:
            problems.append(f"training.mismatch_mode={self.mismatch_mode!r} is not one of: {', '.join(MISMATCH_MODES)}")
        if self.mismatch_level not in MISMATCH_LEVELS:
            problems.append(
                f"training.mismatch_level={self.mismatch_level!r} is not one of: {', '.join(MISMATCH_LEVELS)}"
            )
        if not self.mismatch_cap >= 1:
            problems.append(f"training.mismatch_cap must be >= 1, got {self.mismatch_cap}")
        if not 0 <= self.mismatch_lower <= 1 <= self.mismatch_upper:
            problems.append(
                f"training.mismatch_lower/mismatch_upper must satisfy 0 <= lower <= 1 <= upper, "
                f"got {self.mismatch_lower} / {self.mismatch_upper}"
            )
        return problems

    @property
    def corrects_mismatch(self) -> bool:
        return self.mismatch_mode != "none"

    @property
    def clipped(self) -> bool:
        return self.clip_eps > 0

    @property
    def upper_eps(self) -> float:
        return self.clip_eps_high or self.clip_eps
