"""Compose the `algorithm` group (as the command line does) and build synthetic steps."""

from __future__ import annotations

import copy
import functools

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig

from retrain.algorithm.pipeline import Algorithm
from retrain.config import algorithm_conditions, compose


def compose_algorithm(name: str = "maxrl_gtpo_sepa", *overrides: str) -> DictConfig:
    """`cfg.algorithm` as `python -m retrain algorithm=<name> <overrides>` composes it (a fresh copy)."""
    return copy.deepcopy(_composed((f"algorithm={name}", *overrides)))


@functools.cache
def _composed(overrides: tuple[str, ...]) -> DictConfig:
    """Composing is most of these tests' time, and many build the same algorithm: once per distinct call."""
    return compose(list(overrides)).algorithm


def build(name: str = "maxrl_gtpo_sepa", *overrides: str) -> Algorithm:
    return instantiate(compose_algorithm(name, *overrides))


def preset_names() -> list[str]:
    """The named conditions (`algorithm=<name>`), generated from conf/algorithm/'s options."""
    return sorted(algorithm_conditions().presets())


def synthetic_step(
    groups: int = 3,
    group_size: int = 4,
    tokens: int = 16,
    seed: int = 0,
    planning_rate: float = 0.2,
    entropies: bool = True,
) -> dict:
    """Mixed binary rewards (one uniform group), ragged lengths, random log-probs and planning."""
    generator = torch.Generator().manual_seed(seed)
    rows = groups * group_size
    rewards = (torch.rand(groups, group_size, generator=generator) < 0.5).float()
    rewards[0] = 1.0  # a uniform group
    if groups > 1:
        rewards[1, 0], rewards[1, 1] = 1.0, 0.0  # a group with signal
    lengths = torch.randint(1, tokens + 1, (rows,), generator=generator)
    mask = torch.arange(tokens).unsqueeze(0) < lengths.unsqueeze(1)
    logprobs = torch.log(torch.rand(rows, tokens, generator=generator).clamp_min(1e-4)) * mask
    planning = (torch.rand(rows, tokens, generator=generator) < planning_rate) & mask
    step = {
        "rewards": rewards,
        "logprobs": logprobs,
        "mask": mask,
        "planning": planning,
        "entropies": torch.rand(rows, tokens, generator=generator) * 3.0 * mask if entropies else None,
    }
    return step


def run(algorithm: Algorithm, step: dict, lam_step: int | None = None):
    """begin_step (optionally with the gate open at `lam_step`), then compute."""
    if lam_step is not None:
        algorithm.end_step(1.0)
        algorithm.begin_step(lam_step)
    else:
        algorithm.begin_step(0)
    planning = step["planning"] if algorithm.needs_planning else None
    return algorithm.compute(step["rewards"], step["logprobs"], step["mask"], step["entropies"], planning)
