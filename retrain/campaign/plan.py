"""The jobs a multirun will launch, known before any of them starts.

Expanded the way Hydra's basic sweeper does it (sweeper params first, command-line overrides of the
same key replace them), so job number i of the plan is the job Hydra numbers i. Runs that have not
started yet (queued on SLURM, or later in a sequential sweep) are then reported as pending.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf

CONDITION_KEY = "algorithm"  # the config group whose option is the campaign condition
SEED_KEY = "training.seed"


@dataclass
class PlannedJob:
    num: int
    overrides: list[str]
    condition: str | None  # from the overrides; None when the job keeps the default algorithm
    seed: int | None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def sweep_arguments(config: DictConfig) -> list[str]:
    """The sweeper's params followed by the command line's task overrides."""
    params = config.hydra.sweeper.get("params") or {}
    arguments = [f"{key}={value}" for key, value in params.items()]
    arguments += list(OmegaConf.to_container(config.hydra.overrides.task, resolve=False))
    return arguments


def expand(arguments: list[str]) -> list[PlannedJob]:
    """Cartesian product of the sweeps, in Hydra's job order."""
    parsed = OverridesParser.create().parse_overrides(arguments)
    batch = BasicSweeper.split_arguments(parsed, max_batch_size=None)[0]
    return [PlannedJob(num, list(overrides), *_condition_and_seed(overrides)) for num, overrides in enumerate(batch)]


def planned_jobs(config: DictConfig) -> list[PlannedJob] | None:
    """The plan of a basic-sweeper multirun; None for other sweepers (their runs are found as they start)."""
    target = str(config.hydra.sweeper.get("_target_", ""))
    if not target.endswith("BasicSweeper"):
        return None
    return expand(sweep_arguments(config))


def _condition_and_seed(overrides: list[str]) -> tuple[str | None, int | None]:
    condition = seed = None
    for override in overrides:
        key, _, value = override.lstrip("+~").partition("=")
        if key == CONDITION_KEY:
            condition = value
        elif key == SEED_KEY:
            try:
                seed = int(value)
            except ValueError:
                seed = None
    return condition, seed
