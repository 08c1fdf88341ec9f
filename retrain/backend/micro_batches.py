"""Which rows share a training forward/backward: `backend.micro_batch_tokens` padded tokens at most.

A forward pads its rows to one width: its prompts' longest (left-padded) plus its completions' longest
(right-padded), so a micro-batch takes rows × (prompt width + completion width) tokens of activation
memory, whatever its real tokens. Counting rows instead would weigh a 10,240-token row like a 50-token one.
Rows sorted by completion length are packed greedily: each joins the current micro-batch while the padded
total stays within the budget, else starts the next one; a row over the budget on its own runs alone.
Sorting puts rows of similar length together, so little goes to padding. The split never changes the
gradient: the loss is a token mean over the whole step (docs/loss.md).
"""

from __future__ import annotations

import torch

from retrain.types import Rollouts


def token_micro_batches(prompt_widths: list[int], completion_widths: list[int], budget: int) -> list[list[int]]:
    """Positions of the rows in each micro-batch (see the module docstring); budget 0: all rows in one."""
    order = sorted(range(len(completion_widths)), key=lambda row: completion_widths[row])  # stable: ties keep order
    if budget == 0 or not order:
        return [order] if order else []
    batches = [[order[0]]]
    prompt_width, completion_width = prompt_widths[order[0]], completion_widths[order[0]]
    for row in order[1:]:
        wider_prompt, wider_completion = (
            max(prompt_width, prompt_widths[row]),
            max(completion_width, completion_widths[row]),
        )
        if (len(batches[-1]) + 1) * (wider_prompt + wider_completion) <= budget:
            batches[-1].append(row)
            prompt_width, completion_width = wider_prompt, wider_completion
        else:
            batches.append([row])
            prompt_width, completion_width = prompt_widths[row], completion_widths[row]
    return batches


def row_micro_batches(rollouts: Rollouts, rows: torch.Tensor, budget: int) -> list[torch.Tensor]:
    """The training rows `rows` of `rollouts`, split into micro-batches of at most `budget` padded tokens."""
    prompt_widths = _through_last_real(rollouts.prompt_mask.flip(1))[rows // rollouts.group_size]  # left-padded
    completion_widths = _through_last_real(rollouts.completion_mask[rows])  # right-padded
    batches = token_micro_batches(prompt_widths.tolist(), completion_widths.tolist(), budget)
    return [rows[torch.tensor(batch, device=rows.device)] for batch in batches]


def _through_last_real(mask: torch.Tensor) -> torch.Tensor:
    """[N] columns up to and including each row's last real token (0 for a row without any)."""
    return (mask * torch.arange(1, mask.shape[1] + 1, device=mask.device)).amax(dim=1)
