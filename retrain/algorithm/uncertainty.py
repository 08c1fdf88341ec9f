"""Token uncertainty kinds: how unsure the sampler was about each sampled token.

A kind is a function `(logprobs [N, T], mask [N, T], entropies [N, T] | None) -> [N, T]`.
`algorithm.uncertainty` names a built-in kind (or an alias) or a dotted path to a user function;
a user function may declare `needs_entropies = True` and `metric_prefix = "..."` on itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from retrain.algorithm.tokens import MAX_UNCERTAINTY, capped
from retrain.errors import ConfigError
from retrain.plugins import built_in, declared, locate

UncertaintyFn = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


@built_in
def surprisal(logprobs: torch.Tensor, mask: torch.Tensor, entropies: torch.Tensor | None) -> torch.Tensor:
    """-log p of the sampled token."""
    return capped(logprobs.neg())


@built_in
def predictive_variance(logprobs: torch.Tensor, mask: torch.Tensor, entropies: torch.Tensor | None) -> torch.Tensor:
    """p(1 - p) of the sampled token: the variance of a Bernoulli 'was this token drawn'."""
    p = logprobs.clamp_min(-MAX_UNCERTAINTY).exp()
    return (p * (1.0 - p)).clamp_max(MAX_UNCERTAINTY)


@built_in
def shannon_entropy(logprobs: torch.Tensor, mask: torch.Tensor, entropies: torch.Tensor | None) -> torch.Tensor:
    """-sum q log q over the sampler's whole next-token distribution (served by the engine)."""
    if entropies is None:
        raise ConfigError(
            "uncertainty 'shannon_entropy' needs per-token entropies, but the inference "
            "engine returned none; use algorithm.uncertainty=surprisal or an engine that "
            "returns entropies (inference=pytorch)"
        )
    return entropies.clamp_max(MAX_UNCERTAINTY)


shannon_entropy.needs_entropies = True  # type: ignore[attr-defined]


@dataclass(frozen=True)
class UncertaintyKind:
    """A resolved `algorithm.uncertainty`: the function and what it needs and reports as."""

    name: str
    fn: UncertaintyFn
    needs_entropies: bool
    metric_prefix: str  # metrics go to `<prefix>/exec_var_before`, ... (wandb: train/<prefix>/...)


BUILTIN_KINDS: dict[str, UncertaintyKind] = {
    "surprisal": UncertaintyKind("surprisal", surprisal, False, "surprisal"),
    "predictive_variance": UncertaintyKind("predictive_variance", predictive_variance, False, "predictive_variance"),
    "shannon_entropy": UncertaintyKind("shannon_entropy", shannon_entropy, True, "entropy"),
}
ALIASES: dict[str, str] = {
    "pred_var": "predictive_variance",
    "bernoulli_variance": "predictive_variance",
    "entropy": "shannon_entropy",
    "shannon": "shannon_entropy",
}


def resolve_uncertainty(spec: str) -> UncertaintyKind:
    """A built-in name, an alias, or `module.function` -> UncertaintyKind (ConfigError otherwise)."""
    name = ALIASES.get(spec, spec)
    if name in BUILTIN_KINDS:
        return BUILTIN_KINDS[name]
    choices = ", ".join([*BUILTIN_KINDS, *ALIASES])
    if "." not in spec:
        raise ConfigError(
            f"algorithm.uncertainty={spec!r} is not a known uncertainty kind ({choices}) "
            "nor a dotted path to a function"
        )
    try:
        fn = locate(spec)
    except Exception as error:
        raise ConfigError(f"algorithm.uncertainty={spec!r}: cannot import it ({error})") from error
    if not callable(fn):
        raise ConfigError(
            f"algorithm.uncertainty={spec!r} is a {type(fn).__name__}, not a function "
            "(logprobs, mask, entropies) -> tensor"
        )
    return UncertaintyKind(
        spec, fn, bool(declared(fn, "needs_entropies", False)), str(declared(fn, "metric_prefix", "uncertainty"))
    )
