"""The contracts of an algorithm's pluggable parts, checked on every output of a plugin.

A part of ours is trusted by identity (retrain.plugins.built_in); anything else — a user's
advantage, uncertainty kind, transform or whole algorithm, a subclass of ours included — is wrapped
by `retrain.plugins.checked` with the checks below, which name the plugin and what it returned.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import torch

from retrain.algorithm.base import Algorithm
from retrain.algorithm.tokens import TokenBatch
from retrain.errors import ConfigError
from retrain.plugins import Check, PluginOutputError, check_finite, check_shape, checked, plugin_name


def check_advantage(value: Any, what: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    """An episode advantage: finite float [B, G] for rewards [B, G], finite as the float32 the pipeline
    computes in (a float64 1e300 would turn inf there, and the error would name the pipeline instead)."""
    rewards = args[0]
    return check_finite(check_shape(value, tuple(rewards.shape), what=what).float(), what=what)


def check_uncertainty(value: Any, what: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    """An uncertainty kind: float [N, T] like the mask, finite on real tokens (padding is ignored)."""
    mask = args[1].bool()
    value = check_shape(value, tuple(mask.shape), what=what)
    check_finite(torch.where(mask, value.float(), 0.0), what=what)
    return value


def check_transform(result: Any, what: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> TokenBatch:
    """A token transform: a TokenBatch whose advantages and uncertainty are finite [N, T] (padding zeroed)."""
    batch: TokenBatch = args[0]
    if not isinstance(result, TokenBatch):
        raise PluginOutputError(
            f"{what} returned {type(result).__name__}, expected a TokenBatch "
            "(use dataclasses.replace(batch, advantages=...))"
        )
    shape, mask = tuple(batch.mask.shape), batch.mask
    advantages, uncertainty = (
        check_finite(
            torch.where(mask, check_shape(getattr(result, name), shape, what=f"{what} ({name})").float(), 0.0),
            what=f"{what} ({name})",
        )
        for name in ("advantages", "uncertainty")
    )
    return replace(batch, advantages=advantages, uncertainty=uncertainty, metrics=result.metrics)


def check_compute(output: Any, what: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A whole algorithm's `compute`, held to the same contract as preflight's probe."""
    rewards, mask = _argument(args, kwargs, 0, "rewards"), _argument(args, kwargs, 2, "mask")
    check_output(what, output, rewards.shape[0], mask.bool())
    return output


def check_step_metrics(value: Any, what: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, float]:
    """`begin_step` returns metrics that are logged: a dict of names to finite numbers."""
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, (int, float)) and math.isfinite(v) for k, v in value.items()
    ):
        raise PluginOutputError(
            f"{what}.begin_step returned {value!r}, expected a dict of metric names to finite numbers ({{}} for none)"
        )
    return {k: float(v) for k, v in value.items()}


ADVANTAGE_CHECKS: dict[str, Check] = {"__call__": check_advantage}
UNCERTAINTY_CHECKS: dict[str, Check] = {"__call__": check_uncertainty}
TRANSFORM_CHECKS: dict[str, Check] = {"__call__": check_transform}
ALGORITHM_CHECKS: dict[str, Check] = {"compute": check_compute, "begin_step": check_step_metrics}


def algorithm_what(algorithm: Any) -> str:
    """How errors name an algorithm: its condition and its class."""
    return f"algorithm '{getattr(algorithm, 'name', plugin_name(algorithm))}' ({plugin_name(algorithm)})"


def checked_algorithm(algorithm: Any) -> Algorithm:
    """The algorithm the trainer runs: ours as is, a plugin (a subclass of ours too) with its outputs checked."""
    for attribute in ("name", "label", "token_varying", "needs_planning", "needs_entropies"):
        if not hasattr(algorithm, attribute):
            raise ConfigError(
                f"{algorithm_what(algorithm)} has no `{attribute}`; an algorithm plugin offers "
                "the interface of retrain.algorithm.base.Algorithm (see docs/plugins.md)"
            )
    return checked(algorithm, ALGORITHM_CHECKS, algorithm_what(algorithm))


def check_algorithm_output(algorithm: Any, output: Any, batch_size: int, mask: torch.Tensor) -> None:
    """The contract of `algorithm.compute`: [N, T] finite float advantages, 0 on padding, [B] flags."""
    check_output(algorithm_what(algorithm), output, batch_size, mask)


def check_output(what: str, output: Any, batch_size: int, mask: torch.Tensor) -> None:
    for attribute in ("token_advantages", "group_has_signal", "metrics"):
        if not hasattr(output, attribute):
            raise PluginOutputError(
                f"{what}.compute returned {type(output).__name__} without "
                f"`{attribute}`; return retrain.algorithm.base.AdvantageOutput"
            )
    where = f"{what}.compute (token_advantages)"
    advantages = check_finite(check_shape(output.token_advantages, tuple(mask.shape), what=where), what=where)
    if bool((advantages[~mask] != 0).any()):
        raise PluginOutputError(f"{what}.compute returned non-zero token advantages on padding")
    flags = output.group_has_signal
    if not isinstance(flags, torch.Tensor) or flags.dtype != torch.bool or tuple(flags.shape) != (batch_size,):
        shown = list(flags.shape) if isinstance(flags, torch.Tensor) else type(flags).__name__
        raise PluginOutputError(
            f"{what}.compute returned group_has_signal {shown}, expected a bool tensor of shape [{batch_size}]"
        )
    for key, value in output.metrics.items():
        if not isinstance(key, str) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise PluginOutputError(
                f"{what}.compute returned metric {key!r}={value!r}; metrics must map names to finite numbers"
            )


def require(condition: bool, message: str) -> None:
    """Raise a ConfigError naming the offending key when a configured value is out of range."""
    if not condition:
        raise ConfigError(message)


def _argument(args: tuple[Any, ...], kwargs: dict[str, Any], position: int, name: str) -> Any:
    return args[position] if len(args) > position else kwargs[name]
