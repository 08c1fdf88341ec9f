"""What the trainer may ask of a training backend, and what a backend promises."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from retrain.types import Rollouts, SamplingParams, TrainBatch, TrainResult


@dataclass(frozen=True)
class Capabilities:
    """Static facts about a backend, readable before any model loads."""

    reports_sync_loss: bool = True
    preserves_token_advantages: bool = True
    supports_checkpoint_resume: bool = True
    resume_runtime_dependent: bool = False
    returns_entropies: bool = False

    def as_dict(self) -> dict[str, bool]:
        return asdict(self)


# A plugin backend that declares nothing is assumed to aggregate advantages, so token-varying
# algorithms fail preflight instead of silently losing their credit assignment.
CONSERVATIVE_CAPABILITIES = Capabilities(preserves_token_advantages=False, reports_sync_loss=False)


def capabilities_of(backend_cls: Any) -> Capabilities:
    """Capabilities declared by a backend class (attribute `capabilities`), else conservative."""
    declared = getattr(backend_cls, "capabilities", None)
    if isinstance(declared, Capabilities):
        return declared
    if isinstance(declared, dict):
        return Capabilities(**declared)
    return CONSERVATIVE_CAPABILITIES


@runtime_checkable
class Backend(Protocol):
    """A training backend: samples groups of completions and trains the adapter on them."""

    capabilities: Capabilities
    tokenizer: Any  # a Hugging Face tokenizer (chat template, decode, offsets)

    def encode_prompts(self, prompts: list[str]) -> list[list[int]]:
        """Apply the chat template (generation prompt added) and tokenize."""

    def sample(self, prompt_ids: list[list[int]], group_size: int, sampling: SamplingParams,
               generator_seed: int | None) -> Rollouts:
        """Sample `group_size` completions for every prompt."""

    def train(self, batch: TrainBatch) -> TrainResult:
        """One optimizer step on the batch (never raises on a non-finite loss: it skips)."""

    def save(self, path: Path) -> None:
        """Write the adapter (PEFT format) and the optimizer state into `path`."""

    def load(self, path: Path) -> None:
        """Restore what `save` wrote."""

    def close(self) -> None:
        """Release devices and engines."""
