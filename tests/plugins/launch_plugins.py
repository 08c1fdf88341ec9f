"""Plugins for the launch-safety and secrets tests (tests/test_launch_safety.py, tests/test_secrets.py)."""

from __future__ import annotations

import os
from typing import Any

from retrain.reward.match import match_reward


def token_reward(response: str, reference: str, auth: str = "", **extra: Any) -> float:
    """A reward that calls a service with a token: it must receive the token itself, resolved from MY_TOKEN."""
    if auth != os.environ["MY_TOKEN"]:
        raise RuntimeError("the reward did not receive the token from the environment")
    return match_reward(response, reference)
