"""The algorithm contract: what the trainer calls on an algorithm once per step, and what it gets back.

The built-in `retrain.algorithm.pipeline.Algorithm` composes advantages and transforms; a user's
whole algorithm (`algorithm._target_=my_module.MyAlgorithm`) offers the same interface and has its
outputs checked (retrain.algorithm.checks.checked_algorithm).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch


@dataclass
class AdvantageOutput:
    """What `compute` returns for one step."""

    token_advantages: torch.Tensor  # [N, T] float32, 0 on padding and on groups without signal
    group_has_signal: torch.Tensor  # [B] bool; False: a uniform group, to be left out of training
    metrics: dict[str, float] = field(default_factory=dict)
    episode_advantages: torch.Tensor | None = None  # [B, G] before any token transform


@runtime_checkable
class Algorithm(Protocol):
    """Turns a step's rewards and sampler outputs into token advantages; its state is checkpointed."""

    name: str  # the condition: run dirs, wandb group, metrics' `condition`
    label: str  # the console label, e.g. maxrl+gtpo_sepa
    token_varying: bool  # whether advantages can differ across a completion's tokens
    needs_planning: bool  # whether `compute` reads the planning mask
    needs_entropies: bool  # whether `compute` reads the sampler's entropies

    def begin_step(self, step: int) -> dict[str, float]:
        """Before the step samples: set up the step's schedules; returns metrics of the step known now
        (e.g. a schedule's value), logged with the step's record."""

    def planning_mask(
        self, completion_ids: torch.Tensor, completion_mask: torch.Tensor, tokenizer: Any
    ) -> torch.Tensor:
        """[N, T] bool planning tokens (called only when `needs_planning`)."""

    def compute(
        self,
        rewards: torch.Tensor,
        logprobs: torch.Tensor,
        mask: torch.Tensor,
        entropies: torch.Tensor | None,
        planning: torch.Tensor | None,
    ) -> AdvantageOutput:
        """Token advantages for rewards [B, G] and the [N, T] sampler outputs."""

    def end_step(self, correct_rate: float) -> None:
        """After the step: schedules learn from its correct rate."""

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state, saved in every checkpoint."""

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what `state_dict` returned."""
