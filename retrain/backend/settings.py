"""Typed optimiser and loss settings, built by the composition root from `training.*`.

They are plain dataclasses (not config-group schemas) because they are run-wide knobs that every
backend that trains needs, whatever `backend=` option is chosen. Their defaults live in one place,
the schema of `training.*` (retrain.config.TrainingConfig): `from_config` reads them from there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from retrain.errors import ConfigError

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
        if self.lr <= 0:
            raise ConfigError(f"training.lr must be > 0, got {self.lr}")
        if self.weight_decay < 0:
            raise ConfigError(f"training.weight_decay must be >= 0, got {self.weight_decay}")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(f"training.betas must be two values in [0, 1), got {self.betas}")
        if self.eps <= 0:
            raise ConfigError(f"training.eps must be > 0, got {self.eps}")
        if self.max_grad_norm < 0:
            raise ConfigError(f"training.max_grad_norm must be >= 0 (0 disables), got {self.max_grad_norm}")
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
        if not self.kl_coef >= 0:  # also refuses nan
            raise ConfigError(f"training.kl_coef must be >= 0 (0 = no KL term), got {self.kl_coef}")
        if self.clip_eps < 0:
            raise ConfigError(f"training.clip_eps must be >= 0, got {self.clip_eps}")
        if self.clip_eps_high is not None and self.clip_eps_high < 0:
            raise ConfigError(f"training.clip_eps_high must be >= 0, got {self.clip_eps_high}")
        if self.clip_eps == 0 and self.clip_eps_high:
            raise ConfigError(
                f"training.clip_eps_high={self.clip_eps_high} needs training.clip_eps > 0 "
                "(clip_eps = 0 selects the unclipped importance-sampling loss)"
            )

    @property
    def clipped(self) -> bool:
        return self.clip_eps > 0

    @property
    def upper_eps(self) -> float:
        return self.clip_eps_high or self.clip_eps
