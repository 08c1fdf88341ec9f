"""Episode advantages: exact values per docs/advantages.md, and GRPO's zero-sum property."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from retrain.algorithm.advantages import groups_with_signal, grpo, grpo_std, maxrl, reinforce_pp, rloo

REWARDS = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]])


def test_grpo_centres_without_dividing():
    expected = torch.tensor([[0.5, -0.5, -0.5, 0.5], [0.0] * 4, [0.75, -0.25, -0.25, -0.25]])
    torch.testing.assert_close(grpo(REWARDS), expected)


def test_maxrl_divides_by_the_mean_and_zeroes_all_wrong_groups():
    expected = torch.tensor(
        [
            [0.5 / 0.500001, -0.5 / 0.500001, -0.5 / 0.500001, 0.5 / 0.500001],
            [0.0] * 4,
            [0.75 / 0.250001, -0.25 / 0.250001, -0.25 / 0.250001, -0.25 / 0.250001],
        ]
    )
    torch.testing.assert_close(maxrl(REWARDS), expected)
    negative_mean = torch.tensor([[-1.0, 0.5, 0.0, 0.0]])  # mean -0.125 counts as "all wrong"
    assert torch.equal(maxrl(negative_mean), torch.zeros(1, 4))


def test_reinforce_pp_is_grpo_flagged_for_batch_normalisation():
    torch.testing.assert_close(reinforce_pp(REWARDS), grpo(REWARDS))
    assert reinforce_pp.batch_normalized is True


def test_rloo_uses_the_mean_of_the_others():
    rewards = torch.tensor([[1.0, 0.0, 0.5]])
    expected = torch.tensor([[1.0 - 0.25, 0.0 - 0.75, 0.5 - 0.5]])
    torch.testing.assert_close(rloo(rewards), expected)
    assert torch.equal(rloo(torch.tensor([[0.7]])), torch.zeros(1, 1))


def test_grpo_std_divides_by_the_population_std():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0]])  # mean 0.5, population std 0.5
    torch.testing.assert_close(grpo_std(rewards), torch.tensor([[0.5, -0.5, -0.5, 0.5]]) / (0.5 + 1e-6))


def test_a_group_of_one_gets_zero_advantage_and_is_never_skipped():
    single = torch.tensor([[1.0], [0.0]])
    for advantage in (grpo, maxrl, reinforce_pp, rloo, grpo_std):
        assert torch.equal(advantage(single), torch.zeros(2, 1)), advantage.__name__
    assert groups_with_signal(single).tolist() == [True, True]


def test_uniform_groups_within_tolerance_carry_no_signal():
    rewards = torch.tensor([[0.3, 0.3 + 5e-7, 0.3], [0.3, 0.3 + 5e-6, 0.3]])
    assert groups_with_signal(rewards).tolist() == [False, True]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.lists(st.floats(-5, 5, width=32), min_size=2, max_size=8), min_size=1, max_size=5).filter(
        lambda rows: len({len(r) for r in rows}) == 1
    )
)
def test_grpo_sums_to_zero_per_group(rows):
    advantages = grpo(torch.tensor(rows, dtype=torch.float32))
    scale = max(1.0, max(abs(v) for r in rows for v in r))
    assert torch.all(advantages.sum(dim=1).abs() <= 1e-5 * scale * len(rows[0]))
