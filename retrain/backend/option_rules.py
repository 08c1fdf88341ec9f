"""Range rules of the built-in backends' options, declared on their schema fields (`metadata["validator"]`).

Declared there, a wrong `backend.*` value fails when the run's parts are planned, before data, a
tokenizer or a model loads, and `retrain explain` reports it without running anything. Each rule
raises ValueError saying what is valid; `OptionSpec.check` prefixes the key and the value.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Rule = Callable[[Any], None]


def at_least(low: float, note: str = "") -> Rule:
    """Refuses a value below `low` (and NaN); `note` says what the lowest value means."""

    def rule(value: Any) -> None:
        if not value >= low:
            raise ValueError(_noted(f"must be >= {low}", note))

    return rule


def positive(value: Any) -> None:
    """Refuses zero, a negative value and NaN."""
    if not value > 0:
        raise ValueError("must be > 0")


def within(low: int, high: int, note: str = "") -> Rule:
    """Refuses a value outside `low..high`, both included."""

    def rule(value: Any) -> None:
        if not low <= value <= high:
            raise ValueError(_noted(f"must be in {low}..{high}", note))

    return rule


def zero_or_at_least(low: float, zero_means: str) -> Rule:
    """Refuses a value other than 0 that is below `low`."""

    def rule(value: Any) -> None:
        if value != 0 and not value >= low:
            raise ValueError(f"must be 0 ({zero_means}) or >= {low}")

    return rule


def one_of(choices: tuple[str, ...]) -> Rule:
    """Refuses a value that is not one of `choices`."""

    def rule(value: Any) -> None:
        if value not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}")

    return rule


def must_be_true(why: str) -> Rule:
    """Refuses false: a setting kept only so that turning it off is refused with `why`, not ignored."""

    def rule(value: Any) -> None:
        if value is not True:
            raise ValueError(f"must stay true: {why}")

    return rule


def _noted(rule: str, note: str) -> str:
    return f"{rule} ({note})" if note else rule
