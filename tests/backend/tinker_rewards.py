"""A reward for the backend=tinker trainer tests: the fake service's toy policy writes random bytes, so
the reward is the parity of the completion's character sum (about half of every group scores 1)."""

from __future__ import annotations


def odd_checksum_reward(response: str, reference: str, **extra: object) -> float:
    return float(sum(map(ord, response)) % 2 == 1)
