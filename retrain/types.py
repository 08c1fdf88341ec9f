"""The small typed objects that flow one way through a training step.

Example -> Rollouts -> rewards [B, G] -> token advantages [N, T] -> TrainBatch -> TrainResult
(with the WeightUpdate the inference engine syncs to). Rows are flattened group-major:
row n = b * group_size + g.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: the config schemas import this module, keep it light
    import torch

    from retrain.config import TrainingConfig


@dataclass
class Example:
    """One prompt with its verifiable reference answer."""

    prompt: str  # the user message, before the chat template
    reference: str  # what a correct answer equals (passed to the reward)
    id: str  # stable identifier (for logs and dedup)
    extra: dict[str, Any] = field(default_factory=dict)  # forwarded to rewards as **extra


@dataclass
class SamplingParams:
    """How completions are sampled (the defaults are the model's own, untruncated distribution;
    a run's values come from `training.*`)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    return_entropies: bool = False

    @classmethod
    def from_config(cls, training: TrainingConfig, return_entropies: bool = False) -> SamplingParams:
        return cls(
            max_tokens=training.max_tokens,
            temperature=training.temperature,
            top_p=training.top_p,
            return_entropies=return_entropies,
        )


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
    # [N, T] bool: the tokens the policy sampled, the only ones trained; None = all of completion_mask. A multi-turn
    # environment's own turns sit in the completion (attention context) but are not sampled (retrain.environments)
    sampled_mask: torch.Tensor | None = None

    @property
    def trained_mask(self) -> torch.Tensor:
        """[N, T] bool: the tokens that get advantages and loss (sampled by the policy, not padding)."""
        return self.completion_mask if self.sampled_mask is None else self.sampled_mask & self.completion_mask

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
    row_mask: torch.Tensor  # [N] bool: rows to train on (in a group with signal, and given a verdict by the reward)

    @property
    def num_datums(self) -> int:
        return int(self.row_mask.sum())


@dataclass(frozen=True)
class WeightUpdate:
    """The policy's weights after an optimizer step, in a form an inference engine can load.

    `version` counts the optimizer steps applied (0 = the initial adapter). The weights travel as
    an adapter directory (PEFT format, for engines that load files), as named tensors (named as
    the training model's trainable parameters; live views, so an engine that keeps its own copy
    copies them during `sync`, before the next step changes them), or as a remote reference (a
    service that trains and samples itself keeps the weights: e.g. a `tinker://` sampler path).
    """

    version: int
    adapter_dir: Path | None = None
    tensors: Mapping[str, torch.Tensor] | None = None
    remote: str | None = None

    def __post_init__(self) -> None:
        if sum(form is not None for form in (self.adapter_dir, self.tensors, self.remote)) != 1:
            raise ValueError("a WeightUpdate carries an adapter_dir, named tensors or a remote reference, exactly one")


@dataclass
class TrainResult:
    """What one optimizer step reports."""

    loss: float
    grad_norm: float
    skipped_nonfinite: bool
    num_tokens: int
    metrics: dict[str, float] = field(default_factory=dict)  # policy/ratio_mean, policy/clip_frac, ...
    update: WeightUpdate | None = None  # the new weights; None when no optimizer step was taken
