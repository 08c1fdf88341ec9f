"""Every reward's output is one finite real number, or a clear error (SPEC §8)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from retrain.errors import RewardOutputError
from retrain.reward.checks import checked_reward_value


@pytest.mark.parametrize(("value", "expected"), [(1.0, 1.0), (0, 0.0), (True, 1.0), (np.float32(0.25), 0.25)])
def test_real_numbers_pass_as_floats(value: object, expected: float) -> None:
    result = checked_reward_value(value, "my.reward")
    assert result == expected and type(result) is float


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (float("nan"), "returned nan"),
        (float("inf"), "returned inf"),
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


def test_long_values_are_shortened() -> None:
    with pytest.raises(RewardOutputError) as caught:
        checked_reward_value(list(range(1000)), "my.reward")
    assert len(str(caught.value)) < 400
