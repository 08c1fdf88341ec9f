"""User plugins as a researcher would write them, plugged in from the command line by `_target_`."""

from __future__ import annotations

import os
import time
from typing import ClassVar

from retrain.reward.checks import NoVerdict


def digit_count_reward(response: str, reference: str, **extra: object) -> float:
    """Partial credit: the share of the reference's digits that appear in the response."""
    digits = [c for c in reference if c.isdigit()]
    return sum(c in response for c in digits) / len(digits) if digits else 0.0


def even_answers_only_reward(response: str, reference: str, **extra: object) -> float:
    """Partial credit on problems whose answer ends in an even digit, 0 on the others: a mix of groups with signal
    and uniform ones (dynamic sampling's refill)."""
    return digit_count_reward(response, reference) if reference[-1:] in "02468" else 0.0


def never_correct_reward(response: str, reference: str, **extra: object) -> float:
    """Every completion scores 0: no group has signal, so no step trains."""
    return 0.0


def hanging_reward(response: str, reference: str, **extra: object) -> float:
    """Partial credit, but it never returns on a problem whose answer ends in 7 (a judge that hangs): only
    scoring.timeout_s ends those calls."""
    if reference.endswith("7"):
        time.sleep(3600)
    return digit_count_reward(response, reference)


def flaky_reward(response: str, reference: str, **extra: object) -> float:
    """Raises on every completion that does not contain the reference (a buggy user reward)."""
    if reference not in response:
        raise RuntimeError("flaky reward exploded")
    return 1.0


class ScalarAdvantageBackend:
    """A user's backend that ships one advantage per completion (a service that trains on one scalar per sample).

    It declares so; preflight must then refuse token-varying algorithms before anything loads.
    """

    RETRAIN_BACKEND_CAPABILITIES: ClassVar[dict[str, bool]] = {
        "reports_sync_loss": False,
        "preserves_token_advantages": False,
        "supports_checkpoint_resume": True,
        "resume_runtime_dependent": False,
    }

    def __init__(self, **settings: object) -> None:
        raise RuntimeError("preflight should have stopped this run before the backend was built")


def checksum_judged_reward(response: str, reference: str, **extra: object) -> float:
    """A judge with gaps, decided by the completion's character sum: no verdict at 0 mod 3, correct at 1 mod 3."""
    checksum = sum(map(ord, response)) % 3
    if checksum == 0:
        raise NoVerdict("the judge is unavailable")
    return float(checksum == 1)


def never_judged_reward(response: str, reference: str, **extra: object) -> float:
    """A judge that is always down: no completion ever gets a verdict."""
    raise NoVerdict("the judge is down")


def failing_on_rank_one_reward(response: str, reference: str, **extra: object) -> float:
    """Exact match, except on rank 1 of a data-parallel run, where it breaks its contract (a text score): that rank
    fails at its first step, and the run must end naming it (tests/distributed/test_failures.py)."""
    if os.environ.get("RANK") == "1":
        return "broken"  # type: ignore[return-value]  # the bug this reward stands for
    return 1.0 if reference in response else 0.0
