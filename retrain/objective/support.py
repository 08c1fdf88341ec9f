"""Which objective choices a backend honours: a non-default one it does not is refused before training.

A backend class declares `objective_keys`, the `training.*` keys of this package it computes at any
value (backend=local: all of them); a backend without the declaration (tinker, prime_rl, a plugin) is
taken to compute only the defaults, so a run never silently trains another objective than it asked for.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from retrain.errors import refuse_all
from retrain.plugins import plugin_name

if TYPE_CHECKING:
    from retrain.config import TrainingConfig

# key -> (whether `training` chooses other than the default, the default to set instead)
CHOICES: dict[str, tuple[Callable[[TrainingConfig], bool], Any]] = {
    "objective": (lambda training: training.objective != "ppo", "ppo"),
    "loss_agg": (lambda training: training.loss_agg not in (None, "token_mean"), "token_mean"),
    "entropy_coef": (lambda training: training.entropy_coef != 0, 0.0),
    "lr_schedule": (lambda training: training.lr_schedule != "constant", "constant"),
    "warmup_steps": (lambda training: training.warmup_steps != 0, 0),
    "mismatch_mode": (lambda training: training.mismatch_mode not in (None, "none"), "none"),
    "updates_per_batch": (lambda training: training.updates_per_batch != 1, 1),
    "mini_batches": (lambda training: training.mini_batches != 1, 1),
}
ALL_KEYS = frozenset(CHOICES)


def check_objective_support(training: TrainingConfig, backend_cls: type) -> None:
    """A ConfigError naming each `training.*` choice that `backend_cls` does not declare in `objective_keys`."""
    honoured: frozenset[str] = getattr(backend_cls, "objective_keys", frozenset())
    refuse_all(
        [
            f"training.{key}={getattr(training, key)}: backend {plugin_name(backend_cls)} computes only "
            f"training.{key}={default} (backend=local computes any); set training.{key}={default}"
            for key, (chosen, default) in CHOICES.items()
            if key not in honoured and chosen(training)
        ]
    )
