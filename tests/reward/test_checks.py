"""Every reward's output is one finite real number, or a clear error (docs/rewards.md)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from retrain.errors import RewardOutputError
from retrain.reward.checks import MESSAGE_LIMIT, checked_reward_value, describe_exception


@pytest.mark.parametrize(("value", "expected"), [(1.0, 1.0), (0, 0.0), (True, 1.0), (np.float32(0.25), 0.25)])
def test_real_numbers_pass_as_floats(value: object, expected: float) -> None:
    result = checked_reward_value(value, "my.reward")
    assert result == expected and type(result) is float


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (float("nan"), "returned nan"),
        (float("inf"), "returned inf"),
        pytest.param(10**400, "returned an int of about 400 digits", id="int-past-float"),  # float() overflows
        pytest.param(-(10**5000), "returned an int of about 5000 digits", id="int-past-repr"),  # 4300-digit limit
        (1e308, "returned 1e+308"),  # finite as a float64, inf as the float32 rewards are kept in
        (np.float64(-4e38), "returned np.float64(-4e+38)"),
        ([1.0, 0.0, 1.0], "a list of 3 values ([1.0, 0.0, 1.0])"),
        ((1.0,), "a tuple of 1 values ((1.0,))"),
        (torch.tensor([1.0, 0.0]), "a Tensor of 2 values"),
        (torch.tensor(1.0), "tensor(1.) of type Tensor"),
        ("1.0", "'1.0' of type str"),
        (None, "None of type NoneType"),
    ],
)
def test_anything_else_names_the_reward_and_the_value(value: object, shown: str) -> None:
    with pytest.raises(RewardOutputError) as caught:
        checked_reward_value(value, "my.reward")
    assert "reward my.reward returned" in str(caught.value) and shown in str(caught.value)


def test_the_float32_range_is_the_limit() -> None:
    largest = float(np.finfo(np.float32).max)
    assert checked_reward_value(largest, "my.reward") == largest
    assert checked_reward_value(-largest, "my.reward") == -largest
    with pytest.raises(RewardOutputError, match="at most 3.403e"):
        checked_reward_value(largest * 1.0001, "my.reward")


def test_long_values_are_shortened() -> None:
    with pytest.raises(RewardOutputError) as caught:
        checked_reward_value(list(range(1000)), "my.reward")
    assert len(str(caught.value)) < 400


class Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no")


def test_failure_messages_are_bounded_even_when_they_cannot_be_printed() -> None:
    shown = describe_exception(ValueError("x" * 10**6))
    assert shown.startswith("ValueError: xxx") and shown.endswith(f"({10**6 + 12 - MESSAGE_LIMIT} more characters)")
    assert len(shown) < MESSAGE_LIMIT + 50
    assert describe_exception(Unprintable()) == "Unprintable: <the exception's message could not be formatted>"
