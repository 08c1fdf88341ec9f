"""Episode-level advantages: one number per completion from its group's G rewards.

Each is a plain function `(rewards [B, G]) -> advantages [B, G]`, named in YAML by `_target_`
with `_partial_: true`; a user's own advantage is any function with that signature.
"""

from __future__ import annotations

import torch

from retrain.plugins import built_in

MAXRL_EPS = 1e-6  # below this mean reward a group counts as "all wrong" for MaxRL
STD_EPS = 1e-6
UNIFORM_TOLERANCE = 1e-6  # rewards closer than this are "all equal": the group carries no signal


@built_in
def grpo(rewards: torch.Tensor) -> torch.Tensor:
    """A_i = r_i - mean(r): centred, not divided by the spread."""
    return rewards - rewards.mean(dim=1, keepdim=True)


@built_in
def maxrl(rewards: torch.Tensor) -> torch.Tensor:
    """A_i = (r_i - mean) / (mean + 1e-6), zero when mean <= 1e-6: rare successes weigh most."""
    mean = rewards.mean(dim=1, keepdim=True)
    scaled = (rewards - mean) / (mean + MAXRL_EPS)
    return torch.where(mean > MAXRL_EPS, scaled, torch.zeros_like(scaled))


@built_in
def reinforce_pp(rewards: torch.Tensor) -> torch.Tensor:
    """REINFORCE++: GRPO per group, then batch normalisation over the step's token advantages."""
    return grpo(rewards)


reinforce_pp.batch_normalized = True  # type: ignore[attr-defined]  # read by Algorithm


@built_in
def rloo(rewards: torch.Tensor) -> torch.Tensor:
    """A_i = r_i - mean of the other G-1 rewards (leave-one-out baseline); 0 for a group of one."""
    group_size = rewards.shape[1]
    if group_size < 2:
        return torch.zeros_like(rewards)
    others = (rewards.sum(dim=1, keepdim=True) - rewards) / (group_size - 1)
    return rewards - others


@built_in
def grpo_std(rewards: torch.Tensor) -> torch.Tensor:
    """(r_i - mean) / (population std + 1e-6): the DeepSeekMath form."""
    std = rewards.std(dim=1, keepdim=True, correction=0)
    return (rewards - rewards.mean(dim=1, keepdim=True)) / (std + STD_EPS)


def groups_with_signal(rewards: torch.Tensor) -> torch.Tensor:
    """[B] bool: groups whose rewards are not all equal; a group of one always has signal."""
    if rewards.shape[1] < 2:
        return torch.ones(rewards.shape[0], dtype=torch.bool)
    spread = rewards.max(dim=1).values - rewards.min(dim=1).values
    return spread > UNIFORM_TOLERANCE
