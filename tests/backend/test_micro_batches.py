"""Micro-batches by padded tokens: rows of similar length together, within the budget, a longer row alone."""

from __future__ import annotations

import torch

from retrain.backend.micro_batches import row_micro_batches, token_micro_batches
from retrain.types import Rollouts


def padded_tokens(batch: list[int], prompt_widths: list[int], completion_widths: list[int]) -> int:
    return len(batch) * (max(prompt_widths[row] for row in batch) + max(completion_widths[row] for row in batch))


def test_rows_of_very_different_lengths_land_in_different_micro_batches():
    prompt_widths = [20] * 8
    completion_widths = [10_000, 12, 9_800, 15, 10, 10_240, 14, 11]
    batches = token_micro_batches(prompt_widths, completion_widths, budget=8_192)
    short = {1, 3, 4, 6, 7}
    assert batches[0] == [4, 7, 1, 6, 3]  # the short rows together, shortest first (5 x 35 = 175 tokens)
    assert batches[1:] == [[2], [0], [5]]  # each long row over the budget runs alone
    assert all(not short & set(batch) for batch in batches[1:])


def test_every_row_once_and_each_shared_micro_batch_within_the_budget():
    generator = torch.Generator().manual_seed(0)
    prompt_widths = torch.randint(5, 60, (40,), generator=generator).tolist()
    completion_widths = torch.randint(1, 300, (40,), generator=generator).tolist()
    for budget in (1, 64, 500, 2_000, 100_000):
        batches = token_micro_batches(prompt_widths, completion_widths, budget)
        assert sorted(row for batch in batches for row in batch) == list(range(40))
        assert all(
            len(batch) == 1 or padded_tokens(batch, prompt_widths, completion_widths) <= budget for batch in batches
        )
        lengths = [completion_widths[row] for batch in batches for row in batch]
        assert lengths == sorted(lengths)
    assert len(token_micro_batches(prompt_widths, completion_widths, 1)) == 40
    assert len(token_micro_batches(prompt_widths, completion_widths, 100_000)) == 1


def test_budget_zero_is_one_micro_batch_and_no_rows_none():
    assert token_micro_batches([3, 3, 3], [9, 2, 5], 0) == [[1, 2, 0]]
    assert token_micro_batches([], [], 0) == [] and token_micro_batches([], [], 100) == []


def test_a_micro_batch_is_counted_as_its_forward_pads_it():
    """The forward trims the prompts to their longest (left-padded) and the completions to their longest
    (right-padded): two rows of 2-token prompts with 1- and 3-token completions pad to 2 x (2 + 3) = 10 tokens."""
    prompt_mask = torch.tensor([[False, False, True, True], [False, True, True, True]])
    completion_mask = torch.tensor([[True, False, False, False], [True, True, True, False], [True, True, False, False]])
    rollouts = Rollouts(
        prompt_ids=torch.zeros(2, 4, dtype=torch.long),
        prompt_mask=prompt_mask,
        completion_ids=torch.zeros(3, 4, dtype=torch.long),
        completion_mask=completion_mask,
        logprobs=torch.zeros(3, 4),
        texts=["", "", ""],
        group_size=2,
        hit_max_tokens=torch.zeros(3, dtype=torch.bool),
    )
    rows = torch.tensor([0, 1])  # both rows of prompt 0 (2 tokens)
    assert [batch.tolist() for batch in row_micro_batches(rollouts, rows, 10)] == [[0, 1]]
    assert [batch.tolist() for batch in row_micro_batches(rollouts, rows, 9)] == [[0], [1]]
    rows = torch.tensor([2, 0])  # row 2 continues prompt 1 (3 tokens): 2 x (3 + 2) = 10
    assert [batch.tolist() for batch in row_micro_batches(rollouts, rows, 10)] == [[0, 2]]
    assert [batch.tolist() for batch in row_micro_batches(rollouts, rows, 9)] == [[0], [2]]
