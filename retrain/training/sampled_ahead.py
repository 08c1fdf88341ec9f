"""A step sampled ahead in split mode, kept by the checkpoint of a graceful stop so that the resumed run
trains on exactly what the uninterrupted one would have.

In split mode step s+1 is sampled with step s−1's weights while step s trains (engine/policy_lag 1), except
right after a `save_every` boundary. A stop after step s off a boundary would otherwise throw that sample
away, and the resumed run would sample step s+1 anew with step s's weights (lag 0): other completions,
other metrics. So the sample is finished, written beside the checkpoint (tensors, strings and numbers only,
so the checkpoint still reads with torch's weights-only loader), and picked up again on resume.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from retrain.environments.base import ScoredRollouts
from retrain.types import Example, Rollouts

SAMPLED_AHEAD_FILE = "sampled_ahead.pt"


@dataclasses.dataclass(frozen=True)
class SampledAhead:
    """The finished sample of the step after the checkpoint, and where the data source stood after drawing it."""

    examples: list[Example]
    served_version: int  # the engine's weights version it was sampled with
    rollouts: Rollouts | ScoredRollouts
    data_after: dict[str, Any]  # the data source's state once its prompts were drawn

    def save(self, checkpoint: Path) -> None:
        payload = {
            "examples": [dataclasses.asdict(example) for example in self.examples],
            "served_version": self.served_version,
            "data_after": self.data_after,
            **_rollouts_payload(self.rollouts),
        }
        torch.save(payload, checkpoint / SAMPLED_AHEAD_FILE)

    @classmethod
    def load(cls, checkpoint: Path) -> SampledAhead | None:
        """What `save` wrote into `checkpoint`, or None when it holds no step sampled ahead."""
        path = checkpoint / SAMPLED_AHEAD_FILE
        if not path.is_file():
            return None
        payload = torch.load(path, map_location="cpu", weights_only=True)
        rows = Rollouts(**payload["rollouts"])
        scored = payload["scored"]
        rollouts = rows if scored is None else ScoredRollouts(rollouts=rows, **scored)
        return cls(
            examples=[Example(**example) for example in payload["examples"]],
            served_version=int(payload["served_version"]),
            rollouts=rollouts,
            data_after=payload["data_after"],
        )


def _rollouts_payload(sampled: Rollouts | ScoredRollouts) -> dict[str, Any]:
    rollouts = sampled.rollouts if isinstance(sampled, ScoredRollouts) else sampled
    scored = None
    if isinstance(sampled, ScoredRollouts):
        scored = {field.name: getattr(sampled, field.name) for field in dataclasses.fields(sampled)}
        del scored["rollouts"]
    fields = {field.name: getattr(rollouts, field.name) for field in dataclasses.fields(rollouts)}
    return {"rollouts": fields, "scored": scored}
