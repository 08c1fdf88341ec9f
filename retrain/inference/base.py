"""The inference-engine contract: how a backend gets completions and keeps the sampler's weights current."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from retrain.types import Rollouts, SamplingParams


class StaleWeightsError(RuntimeError):
    """The engine cannot show that it serves the weights of the version it was asked to sync to.

    Silently stale sampler weights make every rollout off-policy without any visible error, so an
    engine raises this instead of carrying on.
    """


@runtime_checkable
class InferenceEngine(Protocol):
    """Samples B×G completions with the policy's current weights."""

    returns_entropies: bool  # whether `generate` can fill Rollouts.entropies

    def generate(self, prompt_ids: list[list[int]], group_size: int, sampling: SamplingParams,
                 generator_seed: int | None) -> Rollouts:
        """Sample `group_size` completions per prompt; rows are group-major (n = b·G + g).
        The same `generator_seed` gives the same rollouts on the same device and weights."""

    def sync_weights(self, version: int) -> None:
        """Serve the policy's weights after optimizer step `version`; raise StaleWeightsError when
        the engine cannot prove it does (adapter version and a log-prob probe)."""

    def close(self) -> None:
        """Release what the engine holds (servers, caches)."""
