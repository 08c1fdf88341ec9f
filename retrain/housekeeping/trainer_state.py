"""What a checkpoint's trainer_state.json holds: everything besides the backend's files that a resumed run
needs to continue the same trajectory. `Trainer.save` writes one, `Trainer._restore` reads one, and a
checkpoint whose state lacks a field is damaged (retrain.housekeeping.rundir.Checkpoint.damage)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TrainerState:
    step: int  # the last completed step (-1: none)
    completed_steps: int
    max_steps: int
    finished: bool  # written by the final checkpoint
    seed: int  # the run's seed, drawn at start when training.seed=-1
    condition: str  # the algorithm's condition name
    data: dict[str, Any]  # the data source's position (epoch, index, shuffle seed)
    algorithm: dict[str, Any]  # the algorithm's schedules and controllers (SEPA's lambda, ...)
    batching: dict[str, Any]  # the batch-size controller's state
    total_correct: int
    total_completions: int
    group_size: int
    eval: dict[str, float]  # held-out results measured so far
    wandb_run_id: str | None  # so a resumed run writes into the same wandb run
    rng: dict[str, Any]  # torch's and Python's generator states
    config_identity: dict[str, Any]  # the settings that must match for a run dir to be resumed

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, payload: dict[str, Any]) -> TrainerState:
        """The state saved in `payload` (keys that are not fields, such as the checkpoint's path, are ignored)."""
        if missing := cls.missing(payload):
            raise ValueError(f"trainer state lacks {', '.join(missing)}")
        return cls(**{name: payload[name] for name in cls.field_names()})

    @classmethod
    def missing(cls, payload: dict[str, Any]) -> list[str]:
        return sorted(set(cls.field_names()) - payload.keys())

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))
