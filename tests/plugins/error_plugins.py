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


class DataNeedingAFile:
    """A data source whose constructor reads a file that is not there (a plugin's mistake, not retrain's)."""

    def __init__(self, seed: int = 0, path: str = "/no/such/problems.jsonl", **options: Any) -> None:
        with open(path) as records:
            records.read()
