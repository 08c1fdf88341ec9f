"""DAPO's soft overlong punishment, checked against the paper's formula by hand (L_max 20, L_cache 4)."""

from __future__ import annotations

import pytest
import torch

from retrain.config import compose
from retrain.config_checks.validation import check_config
from retrain.errors import ConfigError
from retrain.reward.overlong import overlong_buffer, overlong_penalty, shape_rewards


def test_the_penalty_is_zero_then_linear_in_the_buffer_then_minus_one() -> None:
    lengths = torch.tensor([0, 16, 17, 18, 20, 21])
    # 16 = L_max − L_cache: no penalty; 17: (16 − 17)/4; 18: −2/4; 20 = L_max: −1; beyond: −1
    expected = torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0])
    assert torch.equal(overlong_penalty(lengths, max_tokens=20, buffer=4, factor=1.0), expected)
    assert torch.equal(overlong_penalty(lengths, max_tokens=20, buffer=4, factor=0.5), expected / 2)
    assert torch.equal(overlong_penalty(lengths, max_tokens=20, buffer=0, factor=1.0), torch.zeros(6))


def test_shaping_adds_the_penalty_to_judged_rows_only() -> None:
    rewards = torch.tensor([[1.0, 0.0], [1.0, 0.5]])
    excluded = torch.tensor([[False, False], [False, True]])
    shaped, metrics = shape_rewards(rewards, torch.tensor([18, 10, 20, 20]), excluded, 20, 4, 1.0)
    assert torch.equal(shaped, torch.tensor([[0.5, 0.0], [0.0, 0.5]]))
    assert metrics == {"reward/overlong_penalty_mean": pytest.approx(-1.5 / 3)}
    assert shape_rewards(rewards, torch.tensor([20] * 4), excluded, 20, 0, 1.0) == (rewards, {})


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("training.overlong_buffer_frac=-0.1", "training.overlong_buffer_frac"),
        ("training.overlong_buffer_frac=1.5", "training.overlong_buffer_frac"),
        ("training.overlong_penalty=-1", "training.overlong_penalty"),
        ("training.overlong_penalty=nan", "training.overlong_penalty"),
    ],
)
def test_bad_shaping_values_are_refused_naming_the_key(override: str, key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        check_config(compose([override]))


def test_the_buffer_is_a_share_of_max_tokens() -> None:
    assert overlong_buffer(20480, 0.2) == 4096  # the paper's L_cache
    assert (overlong_buffer(8, 0.2), overlong_buffer(8, 0.01), overlong_buffer(8, 0.0)) == (2, 1, 0)
