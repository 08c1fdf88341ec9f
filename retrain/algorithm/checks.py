"""Checks on what pluggable parts return, so a bad plugin fails loudly and by name.

A wrong shape or a NaN from user code would otherwise surface steps later as a silent broadcast
or a diverged adapter; every check here names the plugin and what it returned.
"""

from __future__ import annotations

import functools
import inspect
import math
from typing import Any

import torch

from retrain.errors import ConfigError


class PluginOutputError(ValueError):
    """A pluggable part (advantage, uncertainty, transform, algorithm) returned unusable output."""


def plugin_name(obj: Any) -> str:
    """Dotted name of a function, class, instance or partial (what a user wrote in `_target_`)."""
    target = obj.func if isinstance(obj, functools.partial) else obj
    if not (inspect.isfunction(target) or inspect.isclass(target) or inspect.isbuiltin(target)):
        target = type(target)
    return f"{target.__module__}.{target.__qualname__}"


def declared(obj: Any, attribute: str, default: Any) -> Any:
    """An attribute a plugin declares on itself (looked up through partials), else `default`."""
    if hasattr(obj, attribute):
        return getattr(obj, attribute)
    if isinstance(obj, functools.partial):
        return getattr(obj.func, attribute, default)
    return default


def check_shape(value: Any, shape: tuple[int, ...], *, what: str) -> torch.Tensor:
    """`value` must be a floating-point tensor of exactly `shape` (no silent broadcasting)."""
    if not isinstance(value, torch.Tensor):
        raise PluginOutputError(f"{what} returned {type(value).__name__}, expected a torch.Tensor of shape "
                                f"{list(shape)}")
    if tuple(value.shape) != shape:
        raise PluginOutputError(f"{what} returned shape {list(value.shape)}, expected {list(shape)}")
    if not value.is_floating_point():
        raise PluginOutputError(f"{what} returned dtype {value.dtype}, expected a floating-point tensor")
    return value


def check_finite(value: torch.Tensor, *, what: str) -> torch.Tensor:
    """Every entry finite. A finite row-sum proves it cheaply; only a failure pays for the search."""
    if bool(torch.isfinite(value.sum(dim=-1)).all()) or bool(torch.isfinite(value).all()):
        return value
    index = tuple(int(i) for i in (~torch.isfinite(value)).nonzero()[0])
    raise PluginOutputError(f"{what} returned non-finite values (e.g. {float(value[index])} at index "
                            f"{list(index)})")


def check_algorithm_output(algorithm: Any, output: Any, batch_size: int, mask: torch.Tensor) -> None:
    """The contract of `algorithm.compute`: [N, T] finite float advantages, 0 on padding, [B] flags."""
    name = f"algorithm '{getattr(algorithm, 'name', plugin_name(algorithm))}' ({plugin_name(algorithm)})"
    for attribute in ("token_advantages", "group_has_signal", "metrics"):
        if not hasattr(output, attribute):
            raise PluginOutputError(f"{name}.compute returned {type(output).__name__} without "
                                    f"`{attribute}`; return retrain.algorithm.AdvantageOutput")
    what = f"{name}.compute (token_advantages)"
    advantages = check_finite(check_shape(output.token_advantages, tuple(mask.shape), what=what), what=what)
    if bool((advantages[~mask] != 0).any()):
        raise PluginOutputError(f"{name}.compute returned non-zero token advantages on padding")
    flags = output.group_has_signal
    if not isinstance(flags, torch.Tensor) or flags.dtype != torch.bool or tuple(flags.shape) != (batch_size,):
        shown = list(flags.shape) if isinstance(flags, torch.Tensor) else type(flags).__name__
        raise PluginOutputError(f"{name}.compute returned group_has_signal {shown}, expected a bool "
                                f"tensor of shape [{batch_size}]")
    for key, value in output.metrics.items():
        if not isinstance(key, str) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise PluginOutputError(f"{name}.compute returned metric {key!r}={value!r}; metrics must map "
                                    "names to finite numbers")


def require(condition: bool, message: str) -> None:
    """Raise a ConfigError naming the offending key when a configured value is out of range."""
    if not condition:
        raise ConfigError(message)
