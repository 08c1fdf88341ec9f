"""How to hand a KV cache to a transformers model's forward, across transformers versions.

transformers 5.24 renamed the forward's `past_key_values` argument to `cache`; the old name still works there
but warns on every call and goes away in 5.40. Older 5.x releases know only `past_key_values`.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from transformers import Cache


def with_cache(model: Any, cache: Cache) -> dict[str, Cache]:
    """The keyword argument that passes `cache` to `model`'s forward (a transformers or PEFT-wrapped model)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return {_cache_keyword(type(base).forward): cache}


@functools.cache
def _cache_keyword(forward: Callable[..., Any]) -> str:
    """Read once per model class's forward off its signature: every decode step and training forward asks."""
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"
