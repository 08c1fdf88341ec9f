"""A TrainBatch as the SDK's Datum objects, and what the service's per-token outputs say about the step.

Tinker scores `model_input` and trains on `target_tokens` one position ahead, so each row is its
prompt and completion joined and shifted: model_input = tokens[:-1], targets = tokens[1:]. Prompt
targets carry log-prob 0 and advantage 0 (no gradient); completion targets carry the sampler's
log-probs and our token advantages. The service's policy losses sum over tokens, so the advantages
are divided by the step's contributing-token count: its loss is then our global token mean, with the
same gradient scale as backend=local (tokens whose advantage is exactly 0 leave the mean, as there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from retrain.backend.settings import LossSettings
from retrain.types import TrainBatch


@dataclass
class StepDatums:
    """The datums of one step and where their completion tokens sit."""

    datums: list[Any]  # tinker.Datum, one per trained row
    rows: list[int]  # the batch row of each datum
    starts: list[int]  # index of the first completion target in each datum's target arrays
    sampler_logprobs: list[torch.Tensor]  # [C] per datum: the sampler's log-probs of its completion
    contributing: list[torch.Tensor]  # [C] bool per datum: tokens in the loss (advantage != 0)
    advantages: list[torch.Tensor]  # [C] per datum, as sent
    num_tokens: int


def step_datums(sdk: Any, batch: TrainBatch) -> StepDatums:
    """One Datum per row in `row_mask` with at least one token of nonzero advantage."""
    rollouts = batch.rollouts
    # only the policy's own tokens train: a multi-turn environment's turns are context (Rollouts.trained_mask)
    contributing = rollouts.trained_mask & (batch.advantages != 0) & batch.row_mask.unsqueeze(1)
    num_tokens = int(contributing.sum())
    step = StepDatums(
        datums=[], rows=[], starts=[], sampler_logprobs=[], contributing=[], advantages=[], num_tokens=num_tokens
    )
    if num_tokens == 0:
        return step
    for row in contributing.any(dim=1).nonzero().squeeze(-1).tolist():
        prompt_row = row // rollouts.group_size
        prompt = rollouts.prompt_ids[prompt_row][rollouts.prompt_mask[prompt_row]].tolist()
        mask = rollouts.completion_mask[row]
        completion = rollouts.completion_ids[row][mask].tolist()
        tokens = prompt + completion
        start = len(prompt) - 1  # targets[start] is the first completion token
        logprobs = rollouts.logprobs[row][mask].float()
        advantages = (batch.advantages[row][mask] * contributing[row][mask]).float() / num_tokens
        prompt_zeros = torch.zeros(start, dtype=torch.float32)
        step.datums.append(
            sdk.Datum(
                model_input=sdk.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={
                    "target_tokens": sdk.TensorData.from_torch(torch.tensor(tokens[1:], dtype=torch.int64)),
                    "logprobs": sdk.TensorData.from_torch(torch.cat([prompt_zeros, logprobs])),
                    "advantages": sdk.TensorData.from_torch(torch.cat([prompt_zeros, advantages])),
                },
            )
        )
        step.rows.append(row)
        step.starts.append(start)
        step.sampler_logprobs.append(logprobs)
        step.contributing.append(contributing[row][mask])
        step.advantages.append(advantages)
    return step


def loss_function(settings: LossSettings) -> tuple[str, dict[str, float] | None]:
    """The SDK loss and its config: `importance_sampling` (−ratio·A), or with clip_eps > 0 the SDK's
    clipped `ppo` objective with our ratio bounds 1 − ε and 1 + ε_high."""
    if not settings.clipped:
        return "importance_sampling", None
    return "ppo", {"clip_low_threshold": 1.0 - settings.clip_eps, "clip_high_threshold": 1.0 + settings.upper_eps}


def ratio_metrics(step: StepDatums, outputs: list[Any], settings: LossSettings) -> dict[str, float]:
    """policy/ratio_mean, ratio_max, clip_frac and engine/logprob_abs_diff from the trainer's log-probs
    the service returns per datum (`logprobs`, before the update), as backend=local reports them."""
    ratio_sum, ratio_max, clipped, gap = 0.0, float("-inf"), 0, 0.0
    for index, output in enumerate(outputs):
        trained = output["logprobs"].to_torch().float()[step.starts[index] :][: len(step.sampler_logprobs[index])]
        keep = step.contributing[index]
        log_ratio = (trained - step.sampler_logprobs[index])[keep]
        ratio = log_ratio.exp()
        ratio_sum += float(ratio.sum())
        ratio_max = max(ratio_max, float(ratio.max()))
        gap += float(log_ratio.abs().sum())
        if settings.clipped:  # the clipped branch of the objective was taken (as backend=local counts it)
            advantages = step.advantages[index][keep]
            bounded = ratio.clamp(1.0 - settings.clip_eps, 1.0 + settings.upper_eps) * advantages
            clipped += int((bounded < ratio * advantages).sum())
    return {
        "policy/ratio_mean": ratio_sum / step.num_tokens,
        "policy/ratio_max": ratio_max,
        "policy/clip_frac": clipped / step.num_tokens,
        "engine/logprob_abs_diff": gap / step.num_tokens,
    }
