"""Typed optimiser and loss settings, built by the composition root from `training.*`.

They are plain dataclasses (not config-group schemas) because they are run-wide knobs that every
backend that trains needs, whatever `backend=` option is chosen. Their defaults live in one place,
the schema of `training.*` (retrain.config.TrainingConfig): `from_config` reads them from there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from retrain.errors import refuse_all

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

    @classmethod
    def from_config(cls, training: TrainingConfig) -> OptimSettings:
        return cls(
            lr=training.lr,
            weight_decay=training.weight_decay,
            betas=tuple(training.betas),
            eps=training.eps,
            max_grad_norm=training.max_grad_norm,
        )

    def __post_init__(self) -> None:
        rules = {
            "lr": (self.lr > 0, "> 0"),
            "weight_decay": (self.weight_decay >= 0, ">= 0"),
            "betas": (len(self.betas) == 2 and all(0.0 <= b < 1.0 for b in self.betas), "two values in [0, 1)"),
            "eps": (self.eps > 0, "> 0"),
            "max_grad_norm": (self.max_grad_norm >= 0, ">= 0 (0 disables)"),
        }
        refuse_all(
            [f"training.{key} must be {rule}, got {getattr(self, key)}" for key, (ok, rule) in rules.items() if not ok]
        )
        object.__setattr__(self, "betas", (float(self.betas[0]), float(self.betas[1])))


@dataclass(frozen=True)
class LossSettings:
    """Importance-sampling loss knobs. `clip_eps = 0` is the pure IS loss; `clip_eps_high` None or
    0 means "same as clip_eps" (set it larger for DAPO-style clip-higher). `kl_coef > 0` adds
    kl_coef·k3, the KL estimator against the base model (docs/loss.md); 0 leaves the loss as it is."""

    clip_eps: float
    clip_eps_high: float | None
    kl_coef: float = 0.0

    @classmethod
    def from_config(cls, training: TrainingConfig) -> LossSettings:
        return cls(clip_eps=training.clip_eps, clip_eps_high=training.clip_eps_high, kl_coef=training.kl_coef)

    def __post_init__(self) -> None:
        problems = [
            f"training.kl_coef must be >= 0 (0 = no KL term), got {self.kl_coef}"
            for _ in [0]
            if not self.kl_coef >= 0  # also refuses nan
        ] + [
            f"training.{key} must be >= 0, got {value}"
            for key, value in (("clip_eps", self.clip_eps), ("clip_eps_high", self.clip_eps_high))
            if value is not None and value < 0
        ]
        if self.clip_eps == 0 and self.clip_eps_high:
            problems.append(
                f"training.clip_eps_high={self.clip_eps_high} needs training.clip_eps > 0 "
                "(clip_eps = 0 selects the unclipped importance-sampling loss)"
            )
        refuse_all(problems)

    @property
    def clipped(self) -> bool:
        return self.clip_eps > 0

    @property
    def upper_eps(self) -> float:
        return self.clip_eps_high or self.clip_eps
