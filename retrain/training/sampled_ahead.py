"""The batches sampled ahead, kept by the checkpoint of a graceful stop so that the resumed run trains on exactly what
the uninterrupted one would have (docs/async.md).

With `training.max_staleness` k > 0 the producer (retrain.training.producer) samples and scores batches up to k steps
ahead, each pinned to the weights of an earlier step. A stop after step s would otherwise throw away the batches
pinned to weights older than s + 1's, and the resumed run, which holds only step s + 1's weights, would sample them
anew with those: other completions, other metrics. So they are finished, written beside the checkpoint (tensors,
strings and numbers only, so the checkpoint still reads with torch's weights-only loader), and picked up on resume.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch

from retrain.training.dynamic_sampling import ScoredGroups
from retrain.training.producer import PreparedBatch
from retrain.types import Example, Rollouts

log = logging.getLogger("retrain")

SAMPLED_AHEAD_FILE = "sampled_ahead.pt"


def save_sampled_ahead(batches: list[PreparedBatch], max_staleness: int, checkpoint: Path) -> None:
    """Write `batches` (in step order), sampled under `training.max_staleness`, into `checkpoint`; nothing when there
    are none."""
    if batches:
        payload = {"max_staleness": max_staleness, "batches": [_payload(batch) for batch in batches]}
        torch.save(payload, checkpoint / SAMPLED_AHEAD_FILE)


def load_sampled_ahead(checkpoint: Path, max_staleness: int) -> list[PreparedBatch]:
    """What `save_sampled_ahead` wrote into `checkpoint`, in step order, for a run resumed with `max_staleness`; none
    when the file is absent, or was written under another bound (the checkpoint's data state is from before them,
    so they are sampled again, on this run's schedule)."""
    path = checkpoint / SAMPLED_AHEAD_FILE
    if not path.is_file():
        return []
    payload = torch.load(path, map_location="cpu", weights_only=True)
    if "batches" not in payload:  # retrain before max_staleness kept one unscored step
        log.warning("%s holds a step sampled ahead by an older retrain: it is sampled again", path)
        return []
    if payload["max_staleness"] != max_staleness:
        log.warning(
            "%s holds batches sampled up to %d steps ahead (training.max_staleness=%d); this run's bound is %d: "
            "they are sampled again",
            path,
            payload["max_staleness"],
            payload["max_staleness"],
            max_staleness,
        )
        return []
    return [_batch(entry) for entry in payload["batches"]]


def _payload(batch: PreparedBatch) -> dict[str, Any]:
    groups = batch.groups
    return {
        "step": batch.step,
        "examples": [dataclasses.asdict(example) for example in groups.examples],
        "rollouts": {field.name: getattr(groups.rollouts, field.name) for field in dataclasses.fields(groups.rollouts)},
        "rewards": groups.rewards,
        "excluded": groups.excluded,
        "counts": groups.counts,
        "dapo_metrics": batch.dapo_metrics,
        "served_version": batch.served_version,
        "data_before": batch.data_before,
        "data_after": batch.data_after,
        "times": [batch.sample_time_s, batch.reward_time_s, batch.producer_wait_s],
    }


def _batch(payload: dict[str, Any]) -> PreparedBatch:
    groups = ScoredGroups(
        examples=[Example(**example) for example in payload["examples"]],
        rollouts=Rollouts(**payload["rollouts"]),
        rewards=payload["rewards"],
        excluded=payload["excluded"],
        counts=dict(payload["counts"]),
    )
    sample_s, reward_s, wait_s = payload["times"]
    return PreparedBatch(
        step=int(payload["step"]),
        groups=groups,
        dapo_metrics=dict(payload["dapo_metrics"]),
        served_version=int(payload["served_version"]),
        data_before=payload["data_before"],
        data_after=payload["data_after"],
        sample_time_s=sample_s,
        reward_time_s=reward_s,
        producer_wait_s=wait_s,
    )
