"""DAPO's dynamic sampling with refill (Yu et al. 2025; verl's algorithm.filter_groups; docs/advantages.md).

A group whose rewards are all equal (the advantage code's test, groups_with_signal) has zero advantage and only
shrinks the step's effective batch. With `training.dynamic_sampling.enabled` the step drops such groups and draws
another B prompts from the same seeded data stream, sampling them as extra rounds of the same step (rows
numbered after the earlier rounds', so no two rounds share a sampling seed), until B groups with signal are
collected or `max_draws` extra rounds are spent. The first B groups with signal, in draw order, make the batch;
surplus ones are dropped, as verl drops them. A step that runs out of rounds fills its batch up to B with the
first uniform groups drawn, so the batch always holds B groups (the algorithm's shapes and metrics stay those of
any step) and the uniform ones are left out of training as on any step (`groups_skipped`); only a
batch-normalised algorithm, which trains uniform groups too, trains them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from retrain.algorithm.advantages import groups_with_signal
from retrain.config import DynamicSamplingConfig
from retrain.distributed.rows import combined_metrics
from retrain.types import Example, Rollouts


@dataclass
class ScoredGroups:
    """Prompts with their scored rollouts: rewards [B, G] as scored (excluded rows filled), excluded [B, G]."""

    examples: list[Example]
    rollouts: Rollouts
    rewards: torch.Tensor
    excluded: torch.Tensor
    counts: dict[str, int]  # reward/* counts of these rows


Draw = Callable[[int], ScoredGroups]  # round k >= 1 -> that round's B freshly drawn, sampled and scored prompts
Shaped = Callable[[ScoredGroups], torch.Tensor]  # the rewards [B, G] the advantages will see (after reward shaping)


def collect(
    first: ScoredGroups, draw: Draw, shaped: Shaped, config: DynamicSamplingConfig, batch_size: int, pad_id: int
) -> tuple[ScoredGroups, dict[str, int]]:
    """(the step's batch: the first `batch_size` groups with signal over `first` and the refill rounds, filled up
    with uniform ones when there are too few; dapo/* metrics); `first` unchanged when dynamic sampling is off.
    A group has signal when its `shaped` rewards are not all equal."""
    if not config.enabled:
        return first, {}
    rounds = [first]
    kept = [groups_with_signal(shaped(first))]
    while sum(int(k.sum()) for k in kept) < batch_size and len(rounds) <= config.max_draws:
        rounds.append(draw(len(rounds)))
        kept.append(groups_with_signal(shaped(rounds[-1])))
    drawn = sum(len(r.examples) for r in rounds)
    signal = torch.cat(kept)
    batch = torch.cat([signal.nonzero().flatten(), (~signal).nonzero().flatten()])[:batch_size].tolist()
    metrics = {"dapo/groups_drawn": drawn, "dapo/groups_dropped": drawn - len(batch), "dapo/draws": len(rounds)}
    return selected(concatenated(rounds, pad_id), batch), metrics


def concatenated(parts: Sequence[ScoredGroups], pad_id: int) -> ScoredGroups:
    """The rounds as one batch, in order; tensors padded to the widest round on their layout's side."""
    if len(parts) == 1:
        return parts[0]
    rollouts = [part.rollouts for part in parts]

    def cat(name: str, pad: float = 0, left: bool = False) -> torch.Tensor:
        tensors = [getattr(r, name) for r in rollouts]
        widest = max(t.shape[1] for t in tensors)
        padded = [
            F.pad(
                t.to(torch.uint8) if t.dtype == torch.bool else t,
                [widest - t.shape[1], 0] if left else [0, widest - t.shape[1]],
                value=pad,
            )
            for t in tensors
        ]
        return torch.cat(padded).to(tensors[0].dtype)

    return ScoredGroups(
        examples=[example for part in parts for example in part.examples],
        rollouts=replace(
            rollouts[0],
            prompt_ids=cat("prompt_ids", pad_id, left=True),
            prompt_mask=cat("prompt_mask", left=True),
            completion_ids=cat("completion_ids", pad_id),
            completion_mask=cat("completion_mask"),
            logprobs=cat("logprobs"),
            texts=[text for r in rollouts for text in r.texts],
            hit_max_tokens=torch.cat([r.hit_max_tokens for r in rollouts]),
            entropies=None if rollouts[0].entropies is None else cat("entropies"),
            sampled_mask=None if rollouts[0].sampled_mask is None else cat("sampled_mask"),
            metrics=combined_metrics([r.metrics for r in rollouts]),
        ),
        rewards=torch.cat([part.rewards for part in parts]),
        excluded=torch.cat([part.excluded for part in parts]),
        counts={key: sum(part.counts[key] for part in parts) for key in parts[0].counts},
    )


def selected(groups: ScoredGroups, indices: list[int]) -> ScoredGroups:
    """The groups at `indices` (in that order), with their rows."""
    G = groups.rollouts.group_size
    rows = [g * G + i for g in indices for i in range(G)]
    r = groups.rollouts
    index, row_index = torch.tensor(indices, dtype=torch.long), torch.tensor(rows, dtype=torch.long)
    return replace(
        groups,
        examples=[groups.examples[g] for g in indices],
        rollouts=replace(
            r,
            prompt_ids=r.prompt_ids[index],
            prompt_mask=r.prompt_mask[index],
            completion_ids=r.completion_ids[row_index],
            completion_mask=r.completion_mask[row_index],
            logprobs=r.logprobs[row_index],
            texts=[r.texts[n] for n in rows],
            hit_max_tokens=r.hit_max_tokens[row_index],
            entropies=None if r.entropies is None else r.entropies[row_index],
            sampled_mask=None if r.sampled_mask is None else r.sampled_mask[row_index],
        ),
        rewards=groups.rewards[index],
        excluded=groups.excluded[index],
    )
