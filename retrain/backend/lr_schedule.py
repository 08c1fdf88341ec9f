"""The learning-rate schedule of `training.lr_schedule` (docs/loss.md), as a torch LambdaLR factor.

The factor of optimizer step s (0-based; a step skipped for a non-finite loss does not count) follows
transformers' schedules, so TRL's `lr_scheduler_type` maps one to one: linear warmup s / warmup_steps over
the first `warmup_steps`, then constant, linear or cosine decay from 1 to `min_lr_ratio` at `max_steps`.
The scheduler's state is saved with the optimizer's in every checkpoint, so a resumed run continues it.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from retrain.backend.settings import OptimSettings


def lr_factor(settings: OptimSettings) -> Callable[[int], float]:
    """step → the multiple of `training.lr` that step uses."""
    warmup, total, floor = settings.warmup_steps, settings.max_steps, settings.min_lr_ratio

    def factor(step: int) -> float:
        if step < warmup:
            return step / warmup
        if settings.lr_schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        decay = 1.0 - progress if settings.lr_schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        return floor + (1.0 - floor) * decay

    return factor


def lr_scheduler(optimizer: torch.optim.Optimizer, settings: OptimSettings) -> torch.optim.lr_scheduler.LambdaLR:
    """The LambdaLR that sets `optimizer`'s learning rate before each of its steps."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(settings))
