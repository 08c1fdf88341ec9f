"""Plugins with the mistakes users make, for the tests of how a run reports them (tests/test_cli.py)."""

from __future__ import annotations

from typing import Any


def text_reward(response: str, reference: str, **extra: Any) -> Any:
    """Bug: returns the score as text (read from a file or an API) instead of a number."""
    return "1.0" if reference in response else "0.0"


def _refuse_to_load() -> None:
    raise RuntimeError("this reward holds a connection that cannot be rebuilt in another process")


class UnloadableReward:
    """Pickles in the trainer, but cannot be rebuilt in a scoring worker (like a reward holding a socket)."""

    def __call__(self, response: str, reference: str, **extra: Any) -> float:
        return 1.0

    def __reduce__(self) -> tuple[Any, ...]:
        return _refuse_to_load, ()
