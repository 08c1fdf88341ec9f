"""The contract of a data source that samples and scores its own rollouts, and how its trajectories become rows.

Such a source (an environment) runs whole episodes itself, against the run's policy served over HTTP
(retrain.inference.endpoint), and scores them with its own rubric: the trainer then uses its rollouts
and rewards instead of `engine.generate` and the `reward=` scorer. A multi-turn trajectory becomes one
row: the prompt is everything before the model's first sampled token, the completion everything after
it (the model's turns and the environment's), and `Rollouts.sampled_mask` marks the model's own tokens,
the only ones trained (the environment's stay in the attention context with log-prob 0).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from retrain.model.logprobs import left_pad
from retrain.types import Example, Rollouts, SamplingParams

if TYPE_CHECKING:
    from retrain.inference.endpoint import EngineEndpoint


@dataclass
class Trajectory:
    """One rollout of an episode, as token ids: the prompt, then every later token (model's and environment's)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    sampled: list[bool]  # [len(completion_ids)]: sampled by the model (trained) or written by the environment
    logprobs: list[float]  # [len(completion_ids)]: the sampler's log-prob on sampled tokens, 0 elsewhere
    reward: float | None  # the rubric's reward; None = no verdict (the episode failed): neither trained nor counted
    hit_max_tokens: bool = False
    timed_out: bool = False


@dataclass
class ScoredRollouts:
    """What an environment returns for B prompts x G rollouts: the rows and the rubric's rewards."""

    rollouts: Rollouts
    rewards: torch.Tensor  # [B, G] float32; 0 where excluded
    excluded: torch.Tensor  # [B, G] bool: no verdict (failed episode)
    errors: int = 0  # failed episodes
    timeouts: int = 0  # episodes ended by a deadline
    answers: list[str] | None = None  # each row's last reply, for the run's `reward=` to score; None: rewards are final


@runtime_checkable
class RolloutEnvironment(Protocol):
    """A DataSource that also samples and scores: `connect` once per run, then `sample` every step."""

    def connect(self, endpoint: EngineEndpoint, tokenizer: Any, tokenizer_path: str) -> None:
        """Sample from the OpenAI-compatible `endpoint` (the run's policy, at `endpoint.url`); prompts are rendered
        with the tokenizer at `tokenizer_path` (the policy's), rows padded with `tokenizer`'s pad id."""

    def sample(
        self, examples: list[Example], group_size: int, sampling: SamplingParams, seed: int | None
    ) -> ScoredRollouts:
        """Run `group_size` episodes per example (rows group-major, n = b·G + g) and score them;
        the same seed gives the same requests to the endpoint."""


def rollouts_from_trajectories(
    groups: list[list[Trajectory]], sampling: SamplingParams, pad_id: int, decode: Any
) -> ScoredRollouts:
    """Padded Rollouts (with `sampled_mask`) and [B, G] rewards from B groups of G trajectories.

    A group's rows share one prompt (its first row with tokens gives it; a row whose prompt differs is
    an error: the environment changed the prompt between rollouts of one task)."""
    group_size = len(groups[0])
    prompts: list[list[int]] = []
    for b, group in enumerate(groups):
        shared = next((t.prompt_ids for t in group if t.prompt_ids), [pad_id])
        for g, trajectory in enumerate(group):
            if trajectory.prompt_ids and trajectory.prompt_ids != shared:
                raise ValueError(
                    f"rollout {g} of prompt {b} starts from a different prompt than rollout 0: the rows of a group "
                    "must share their prompt (does the environment randomise its prompt per rollout?)"
                )
        prompts.append(shared)
    prompt_ids, prompt_mask = left_pad(prompts, pad_id, torch.device("cpu"))
    rows = [t for group in groups for t in group]
    width = max(1, max(len(t.completion_ids) for t in rows))
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    sampled = torch.zeros((len(rows), width), dtype=torch.bool)
    logprobs = torch.zeros((len(rows), width), dtype=torch.float32)
    for n, t in enumerate(rows):
        length = len(t.completion_ids)
        if length:
            ids[n, :length] = torch.tensor(t.completion_ids, dtype=torch.long)
            mask[n, :length] = True
            sampled[n, :length] = torch.tensor(t.sampled, dtype=torch.bool)
            logprobs[n, :length] = torch.tensor(t.logprobs, dtype=torch.float32)
    excluded = torch.tensor([t.reward is None for t in rows], dtype=torch.bool)
    rewards = torch.tensor([0.0 if t.reward is None else t.reward for t in rows], dtype=torch.float32)
    rollouts = Rollouts(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=ids,
        completion_mask=mask,
        logprobs=logprobs,
        texts=[decode(t.completion_ids) for t in rows],
        group_size=group_size,
        hit_max_tokens=torch.tensor([t.hit_max_tokens for t in rows], dtype=torch.bool),
        temperature=sampling.temperature,
        sampled_mask=sampled,
    )
    return ScoredRollouts(
        rollouts=rollouts,
        rewards=rewards.view(len(groups), group_size),
        excluded=excluded.view(len(groups), group_size),
        errors=int(excluded.sum()),
        timeouts=sum(t.timed_out for t in rows),
    )
