"""The check every reward's output passes: one finite real number per completion."""

from __future__ import annotations

import contextlib
import math
import numbers
from collections.abc import Sized

from retrain.errors import RewardOutputError

_REPR_LIMIT = 120


def checked_reward_value(value: object, reward_name: str) -> float:
    """`value` as a float, or RewardOutputError naming the reward and the offending value.

    A wrong output is a bug in the reward, not a flaky completion, so it stops the run instead of
    being scored 0: silently broadcasting a list or a NaN into the advantages is far worse.
    """
    if isinstance(value, numbers.Real):
        number = float(value)
        if math.isfinite(number):
            return number
        raise RewardOutputError(f"reward {reward_name} returned {number!r}; a reward must return a finite number")
    shown = repr(value)
    if len(shown) > _REPR_LIMIT:
        shown = shown[:_REPR_LIMIT] + "..."
    what = f"{shown} of type {type(value).__name__}"
    if isinstance(value, Sized) and not isinstance(value, (str, bytes)):
        with contextlib.suppress(TypeError):  # a 0-d tensor or array has __len__ but no length
            what = f"a {type(value).__name__} of {len(value)} values ({shown})"
    raise RewardOutputError(
        f"reward {reward_name} returned {what}; a reward is called once per completion and must return one finite float"
    )
