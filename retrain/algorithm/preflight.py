"""Preflight: run the configured algorithm on a synthetic step before any model loads.

It catches, in seconds instead of after a model download, an algorithm (or one of its plugins) that
returns a wrong shape or NaNs, an uncertainty kind the engine cannot serve, and token-varying
advantages headed for a backend that would silently collapse them to one number per completion.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

from retrain.algorithm.checks import algorithm_what, check_algorithm_output
from retrain.backend.base import Capabilities
from retrain.errors import WRONG_ARGUMENTS, ConfigError

PROBE_GROUPS, PROBE_GROUP_SIZE, PROBE_TOKENS = 2, 4, 12
LATE_STEP = 10**6  # the probe resolves lambda at a late step with the gate open, so SEPA really pools
VARIATION_TOLERANCE = 1e-6


@dataclass(frozen=True)
class ProbeReport:
    """What preflight learned about the algorithm."""

    token_varying: bool  # declared, or observed on the probe
    needs_planning: bool
    needs_entropies: bool
    metric_keys: tuple[str, ...]


def synthetic_step(needs_planning: bool, with_entropies: bool) -> dict[str, Any]:
    """A small, fixed, uneven step: mixed rewards, ragged lengths, some planning tokens."""
    generator = torch.Generator().manual_seed(0)
    rows = PROBE_GROUPS * PROBE_GROUP_SIZE
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 1.0]])
    lengths = torch.tensor([12, 9, 5, 12, 7, 12, 3, 10])
    mask = torch.arange(PROBE_TOKENS).unsqueeze(0) < lengths.unsqueeze(1)
    logprobs = -torch.rand(rows, PROBE_TOKENS, generator=generator) * 3.0 * mask
    planning = None
    if needs_planning:
        planning = torch.zeros(rows, PROBE_TOKENS, dtype=torch.bool)
        planning[:, 1:3] = True
        planning &= mask
    entropies = torch.rand(rows, PROBE_TOKENS, generator=generator) * 2.0 * mask if with_entropies else None
    return {"rewards": rewards, "logprobs": logprobs, "mask": mask, "entropies": entropies, "planning": planning}


def _varies_within_rows(advantages: torch.Tensor, mask: torch.Tensor) -> bool:
    high = advantages.masked_fill(~mask, -torch.inf).max(dim=1).values
    low = advantages.masked_fill(~mask, torch.inf).min(dim=1).values
    real = mask.any(dim=1)
    return bool(((high - low)[real] > VARIATION_TOLERANCE).any())


def preflight(
    algorithm: Any,
    capabilities: Capabilities,
    backend_name: str = "local",
    engine_returns_entropies: bool | None = None,
    engine_name: str | None = None,
) -> ProbeReport:
    """Raise ConfigError naming the algorithm and the backend/engine when they cannot work together.

    Entropies are available when the backend carries them (`capabilities.returns_entropies`) and,
    if given, the inference engine computes them (`engine_returns_entropies`).
    """
    name = getattr(algorithm, "name", type(algorithm).__name__)
    serving = f"backend '{backend_name}'" + (f" with engine '{engine_name}'" if engine_name else "")
    entropies_available = capabilities.returns_entropies and engine_returns_entropies is not False
    if algorithm.needs_entropies and not entropies_available:
        kind = getattr(getattr(algorithm, "uncertainty", None), "name", "its uncertainty kind")
        lacking = (
            f"backend '{backend_name}'" if not capabilities.returns_entropies else f"inference engine {engine_name}"
        )
        raise ConfigError(
            f"algorithm '{name}' uses uncertainty {kind!r}, which needs per-token Shannon "
            f"entropies, but {lacking} cannot return them; set algorithm.uncertainty=surprisal "
            "(or predictive_variance), or use backend=local with inference=pytorch"
        )
    probe = copy.deepcopy(algorithm)  # the real algorithm's schedule state stays untouched
    probe.end_step(1.0)
    probe.begin_step(LATE_STEP)
    step = synthetic_step(algorithm.needs_planning, entropies_available)
    try:
        output = probe.compute(**step)
    except TypeError as error:
        if not WRONG_ARGUMENTS.search(str(error)):
            raise
        raise ConfigError(  # a `+key=value` typo reaches a part as an argument it does not take
            f"{algorithm_what(algorithm)} failed on a synthetic step, before training: {error}; "
            "check the arguments its parts are given (`+algorithm.<part>.<key>=...`)"
        ) from error
    check_algorithm_output(algorithm, output, PROBE_GROUPS, step["mask"])
    observed = _varies_within_rows(output.token_advantages, step["mask"])
    token_varying = bool(algorithm.token_varying) or observed
    if token_varying and not capabilities.preserves_token_advantages:
        why = "its advantages vary across a completion's tokens"
        if observed and not algorithm.token_varying:
            why = "its probe produced advantages that vary across a completion's tokens (it declares none)"
        raise ConfigError(
            f"algorithm '{name}' cannot run on {serving}: {why}, but the backend sends one "
            "advantage per completion (preserves_token_advantages=false), which would silently "
            "discard its credit assignment. Use a token-uniform algorithm (grpo_none, maxrl_none) "
            "or a backend that preserves token advantages (backend=local)"
        )
    return ProbeReport(
        token_varying, bool(algorithm.needs_planning), bool(algorithm.needs_entropies), tuple(sorted(output.metrics))
    )
