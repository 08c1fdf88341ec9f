"""The trainer's view of a data-parallel step: which rows this rank samples and trains, and what it gathers.

On one process (World of size 1) every method returns its input: the trainer has one code path, and a rank's
share of a step is the whole step.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch

from retrain.distributed.gradients import weights_checksum
from retrain.distributed.rows import gather_rollouts, gather_rows
from retrain.distributed.world import World, all_max, all_sum, check_agreed, gather_objects
from retrain.types import Example, Rollouts, TrainBatch

WEIGHTS_CHECK_EVERY = 10  # steps between the ranks' comparisons of their adapter checksums


class StepShare:
    """This rank's share of each step (contiguous groups, World.share) and the collectives that make it whole.
    `pad_id` pads the ranks' gathered token ids as the engine pads them."""

    def __init__(self, world: World, pad_id: int) -> None:
        self.world = world
        self.pad_id = pad_id
        self.gather_time = 0.0  # seconds the last gather took

    def examples(self, examples: list[Example], group_size: int) -> tuple[list[Example], int]:
        """(this rank's prompts, the global index of their first row): its rows draw what one process draws."""
        first, stop = self.world.share(len(examples))
        return examples[first:stop], first * group_size

    def gathered(
        self, rollouts: Rollouts, rewards: torch.Tensor, excluded: torch.Tensor, counts: dict[str, int]
    ) -> tuple[Rollouts, torch.Tensor, torch.Tensor, dict[str, int]]:
        """Every rank's scored share as the whole batch: rollouts, rewards [B, G], excluded [B, G], summed counts."""
        if not self.world.distributed:
            return rollouts, rewards, excluded, counts
        started = time.perf_counter()
        rollouts = gather_rollouts(rollouts, self.pad_id)
        rewards, excluded = gather_rows(rewards), gather_rows(excluded.to(torch.uint8)).bool()
        totals = all_sum(torch.tensor(list(counts.values()), dtype=torch.long))
        counts = dict(zip(counts, (int(total) for total in totals), strict=True))
        self.gather_time = time.perf_counter() - started
        return rollouts, rewards, excluded, counts

    def own_rows(self, batch: TrainBatch) -> TrainBatch:
        """The batch with only this rank's rows to train (the backend all-reduces the rest)."""
        if not self.world.distributed:
            return batch
        G = batch.rollouts.group_size
        first, stop = self.world.share(batch.rollouts.batch_size)
        own = torch.zeros_like(batch.row_mask)
        own[first * G : stop * G] = True
        return TrainBatch(rollouts=batch.rollouts, advantages=batch.advantages, row_mask=batch.row_mask & own)

    def metrics(self, sample_time: float) -> dict[str, Any]:
        """dist/*: the world size, the slowest and fastest rank's sampling, the rollouts' gather (none on one process)."""
        if not self.world.distributed:
            return {}
        times = gather_objects(sample_time)
        return {
            "dist/world_size": self.world.size,
            "dist/sample_time_max_s": max(times),
            "dist/sample_time_min_s": min(times),
            "dist/gather_time_s": self.gather_time,
        }

    def check_same_weights(self, tensors: Mapping[str, torch.Tensor], step: int) -> None:
        """Every WEIGHTS_CHECK_EVERY steps: ranks whose adapters are not bit-identical stop the run, naming the step."""
        if self.world.distributed and (step + 1) % WEIGHTS_CHECK_EVERY == 0:
            check_agreed(
                f"adapter checksum after step {step} (the ranks' weights diverged)", weights_checksum(dict(tensors))
            )

    def any_rank(self, asked: bool) -> bool:
        """Whether any rank asks (to stop: a signal reaches ranks at different moments, and a rank that stopped
        alone would leave the others waiting in the next step's gather)."""
        if not self.world.distributed:
            return asked
        return bool(all_max(torch.tensor(int(asked))))
