"""What the trainer may ask of a training backend, and what a backend promises.

A backend trains; an inference engine samples (retrain.inference.base). The trainer holds both:
`backend.train(batch)` returns the new weights as a WeightUpdate, the trainer hands them to
`engine.sync(update)` and proves the engine serves them by comparing the two sides' log-probs on a
fixed probe. The composition root (retrain.run.build_part) builds every backend as
`Backend(model=ModelSpec, optim=OptimSettings, loss=LossSettings, seed=int, **its config keys)`; a built-in
converts the keys through its schema (retrain.settings_object), and takes the schema's object too.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from retrain.model.probe import check_probe_logprobs
from retrain.model.resources import EngineResources
from retrain.plugins import Check, PluginOutputError
from retrain.types import TrainBatch, TrainResult, WeightUpdate

if TYPE_CHECKING:
    from retrain.model.probe import Probe


@dataclass(frozen=True)
class Capabilities:
    """Static facts about a backend, readable before any model loads."""

    reports_sync_loss: bool = True
    preserves_token_advantages: bool = True
    supports_checkpoint_resume: bool = True
    resume_runtime_dependent: bool = False
    returns_entropies: bool = False
    samples_itself: bool = False  # the backend is its own inference engine (a remote service); `inference` unused

    def as_dict(self) -> dict[str, bool]:
        return asdict(self)


# A plugin backend that declares nothing is assumed to aggregate advantages, so token-varying
# algorithms fail preflight instead of silently losing their credit assignment (retrain.backend.capabilities).
CONSERVATIVE_CAPABILITIES = Capabilities(preserves_token_advantages=False, reports_sync_loss=False)


@runtime_checkable
class Backend(Protocol):
    """A training backend: trains the adapter on a batch and reports the new weights."""

    capabilities: Capabilities
    checkpoint_files: tuple[str, ...]  # what `save` writes into a checkpoint dir; one missing marks it damaged
    probe_tolerance: float  # largest mean |Δ log-prob| between engine and trainer on the probe that counts as fresh

    def engine_resources(self) -> EngineResources:
        """What an inference engine beside this backend may use (the live model for an in-process one)."""

    def train(self, batch: TrainBatch) -> TrainResult:
        """One optimizer step on the batch, its WeightUpdate in the result (None when no step was
        taken: nothing to train on, or a non-finite loss, which skips the step rather than raising)."""

    def probe_logprobs(self, probe: Probe) -> torch.Tensor:
        """[K] log-probs at T = 1 of the probe's completion tokens, through the training forward."""

    def save(self, path: Path) -> None:
        """Write the adapter (PEFT format) and the optimizer state into `path`."""

    def load(self, path: Path) -> WeightUpdate:
        """Restore what `save` wrote; returns the restored weights for the engine to sync to."""

    def close(self) -> None:
        """Release devices and engines."""


def check_train_result(result: Any, what: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> TrainResult:
    """The contract of `train`: a TrainResult with finite numbers, and a WeightUpdate when a step was taken."""
    if not isinstance(result, TrainResult):
        raise PluginOutputError(f"{what}.train returned {type(result).__name__}, expected a TrainResult")
    if result.update is not None and not isinstance(result.update, WeightUpdate):
        raise PluginOutputError(
            f"{what}.train returned update={type(result.update).__name__}, expected a WeightUpdate or None"
        )
    numbers = dict(result.metrics)
    if not result.skipped_nonfinite:
        numbers.update(loss=result.loss, grad_norm=result.grad_norm)
    for key, value in numbers.items():
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            raise PluginOutputError(
                f"{what}.train returned {key}={value!r}; expected a finite number "
                "(a non-finite loss sets skipped_nonfinite instead)"
            )
    return result


BACKEND_CHECKS: dict[str, Check] = {"train": check_train_result, "probe_logprobs": check_probe_logprobs}
