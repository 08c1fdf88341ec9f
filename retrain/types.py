"""The small typed objects that flow one way through a training step.

Example -> Rollouts -> rewards [B, G] -> token advantages [N, T] -> TrainBatch -> TrainResult.
Rows are flattened group-major: row n = b * group_size + g.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: the config schemas import this module, keep it light
    import torch


@dataclass
class Example:
    """One prompt with its verifiable reference answer."""

    prompt: str  # the user message, before the chat template
    reference: str  # what a correct answer equals (passed to the reward)
    id: str  # stable identifier (for logs and dedup)
    extra: dict[str, Any] = field(default_factory=dict)  # forwarded to rewards as **extra


@dataclass
class SamplingParams:
    """How completions are sampled."""

    max_tokens: int
    temperature: float = 0.7
    top_p: float = 0.95
    return_entropies: bool = False


@dataclass
class Rollouts:
    """B prompts x G completions, as padded tensors (N = B * G rows)."""

    prompt_ids: torch.Tensor  # [B, P] long, left-padded
    prompt_mask: torch.Tensor  # [B, P] bool
    completion_ids: torch.Tensor  # [N, T] long, right-padded
    completion_mask: torch.Tensor  # [N, T] bool: real completion tokens (EOS included)
    logprobs: torch.Tensor  # [N, T] float32: sampler log-prob of each sampled token, 0 on padding
    texts: list[str]  # [N] decoded completions (special tokens skipped)
    group_size: int
    hit_max_tokens: torch.Tensor  # [N] bool: stopped by max_tokens, not EOS
    entropies: torch.Tensor | None = None  # [N, T] float32 Shannon entropy of the sampled distribution
    temperature: float = 1.0  # what the log-probs were taken at (training recomputes them at the same T)
    metrics: dict[str, float] = field(default_factory=dict)  # sampler statistics, e.g. policy/top_p_mass

    @property
    def batch_size(self) -> int:
        return self.prompt_ids.shape[0]

    @property
    def num_rows(self) -> int:
        return self.completion_ids.shape[0]


@dataclass
class TrainBatch:
    """What the backend trains on: the kept rollouts' rows and their token advantages."""

    rollouts: Rollouts
    advantages: torch.Tensor  # [N, T] float32, 0 on padding and on dropped rows
    row_mask: torch.Tensor  # [N] bool: rows that belong to a group with signal

    @property
    def num_datums(self) -> int:
        return int(self.row_mask.sum())


@dataclass
class TrainResult:
    """What one optimizer step reports."""

    loss: float
    grad_norm: float
    skipped_nonfinite: bool
    num_tokens: int
    metrics: dict[str, float] = field(default_factory=dict)  # policy/ratio_mean, policy/clip_frac, ...
