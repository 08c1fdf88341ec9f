"""The check every reward's output passes (one finite real number per completion), and how a reward says
it could not score a completion at all."""

from __future__ import annotations

import contextlib
import numbers
from collections.abc import Sized

from retrain.errors import RewardOutputError

FLOAT32_MAX = 3.4028234663852886e38  # rewards travel as float32: a larger number would become inf there
MESSAGE_LIMIT = 500  # characters of a reward's failure message kept for logs and metrics
_REPR_LIMIT = 120


class NoVerdict(Exception):
    """Raised by a reward that could not score a completion (its judge server failed, or answered neither
    yes nor no): the row is excluded from training and counted in `reward/excluded`, never scored 0."""


def bounded(text: str, limit: int = MESSAGE_LIMIT) -> str:
    """`text` cut to `limit` characters, saying how much was cut (a reward's message may be megabytes)."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more characters)"


def describe_exception(exc: BaseException) -> str:
    """`Type: message`, bounded, even for an exception whose `__str__` itself fails."""
    try:
        message = str(exc)
    except Exception:
        message = "<the exception's message could not be formatted>"
    return bounded(f"{type(exc).__name__}: {message}")


def checked_reward_value(value: object, reward_name: str) -> float:
    """`value` as a float, or RewardOutputError naming the reward and the offending value.

    A wrong output is a bug in the reward, not a flaky completion, so it stops the run instead of
    being scored 0: silently broadcasting a list or a NaN into the advantages is far worse. The range is
    float32's, the dtype rewards are kept in: `1e308` is finite here but would be inf in the advantages.
    """
    if isinstance(value, numbers.Real):
        try:
            number = float(value)
        except OverflowError:  # an int (or Fraction) beyond any float: 10**400
            number = float("inf")
        if abs(number) <= FLOAT32_MAX:  # False for nan, inf and anything float32 cannot hold
            return number
        raise RewardOutputError(
            f"reward {reward_name} returned {_shown_number(value)}; a reward must return a finite number "
            f"of at most {FLOAT32_MAX:.4g} in magnitude (rewards are float32)"
        )
    shown = _shown(value)
    what = f"{shown} of type {type(value).__name__}"
    if isinstance(value, Sized) and not isinstance(value, (str, bytes)):
        with contextlib.suppress(TypeError):  # a 0-d tensor or array has __len__ but no length
            what = f"a {type(value).__name__} of {len(value)} values ({shown})"
    raise RewardOutputError(
        f"reward {reward_name} returned {what}; a reward is called once per completion and must return one finite float"
    )


def _shown_number(value: numbers.Real) -> str:
    """A number as the error shows it: an int too long to print whole (Python refuses past 4300 digits) by size."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 256:
        return f"an int of about {int(value.bit_length() * 0.30103)} digits"
    return _shown(value)


def _shown(value: object) -> str:
    try:
        shown = repr(value)
    except Exception:  # a repr that raises (or an int past Python's digit limit)
        shown = f"<{type(value).__name__}>"
    return shown if len(shown) <= _REPR_LIMIT else shown[:_REPR_LIMIT] + "..."
