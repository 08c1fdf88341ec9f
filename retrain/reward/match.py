"""`reward=match`: exact string match of the last boxed answer against the reference."""

from __future__ import annotations

from typing import Any

from retrain.plugins import built_in
from retrain.reward.extract import last_boxed


@built_in
def match_reward(response: str, reference: str, **extra: Any) -> float:
    """1.0 when the last boxed answer, stripped, equals the stripped reference; else 0.0.

    An empty reference never matches: otherwise every unboxed completion would score as correct.
    """
    expected = reference.strip()
    if not expected:
        return 0.0
    answer = last_boxed(response)
    return 1.0 if answer is not None and answer.strip() == expected else 0.0
