"""The jobs a multirun will launch, known before any of them starts.

Expanded the way Hydra's basic sweeper does it (sweeper params first, command-line overrides of the
same key replace them), with Hydra's public override parser, so job number i of the plan is the job
Hydra numbers i (tests/campaign/test_plan.py holds the two to the same order). Runs that have not
started yet (queued on SLURM, or later in a sequential sweep) are then reported as pending.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf, open_dict, read_write
from omegaconf.errors import OmegaConfBaseException

from retrain.config import container_dict, container_list
from retrain.config_checks.compose_errors import COMPOSE_ERRORS, compose_error_line
from retrain.errors import ConfigError
from retrain.housekeeping.secrets import masked_override

CONDITION_KEY = "algorithm"  # the config group whose option is the campaign condition
SEED_KEY = "training.seed"
DEFAULT_SUBDIR = "${algorithm.name}_s${training.seed}"  # conf/config.yaml's hydra.sweep.subdir


@dataclass
class PlannedJob:
    num: int
    overrides: list[str]
    condition: str | None  # from the overrides; None when the job keeps the default algorithm
    seed: int | None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def sweep_arguments(config: DictConfig) -> list[str]:
    """The sweeper's params followed by the command line's task overrides, as typed (`${oc.env:...}` unresolved)
    and with secrets masked: the plan is written into the sweep's manifest."""
    params = config.hydra.sweeper.get("params")
    swept = container_dict(params, "hydra.sweeper.params", resolve=False) if params else {}
    arguments = [f"{key}={value}" for key, value in swept.items()]
    arguments += [str(o) for o in container_list(config.hydra.overrides.task, "hydra.overrides.task", resolve=False)]
    return [masked_override(argument) for argument in arguments]


def expand(arguments: list[str]) -> list[PlannedJob]:
    """Cartesian product of the sweeps, in Hydra's job order: the basic sweeper's rule on parsed overrides.

    Each key is one factor of the product, at the position where it first appears; a later override
    of the same key (the command line after the sweeper's params) replaces that factor's values.
    """
    factors: dict[str, list[str]] = {}
    for override in OverridesParser.create().parse_overrides(arguments):
        key = override.get_key_element()
        if override.is_discrete_sweep():  # a,b,c / choice(...) / range(...)
            factors[key] = [f"{key}={value}" for value in override.sweep_string_iterator()]
        elif override.is_sweep_override():
            raise ConfigError(f"{override.input_line}: the basic sweeper sweeps only lists, choice() and range()")
        else:
            factors[key] = [f"{key}={override.get_value_element_as_str()}"]
    jobs = itertools.product(*factors.values())
    return [PlannedJob(num, list(overrides), *_condition_and_seed(overrides)) for num, overrides in enumerate(jobs)]


def planned_jobs(config: DictConfig) -> list[PlannedJob] | None:
    """The plan of a basic-sweeper multirun; None for other sweepers (their runs are found as they start)."""
    target = str(config.hydra.sweeper.get("_target_", ""))
    if not target.endswith("BasicSweeper"):
        return None
    jobs = expand(sweep_arguments(config))
    for job in jobs:
        if _reshapes_algorithm(job.overrides):
            job.condition = _composed_condition(config, job.overrides)
    return jobs


def check_run_dirs_apart(config: DictConfig, jobs: list[PlannedJob]) -> None:
    """ConfigError when two planned jobs would share a run dir (`hydra.sweep.subdir`), naming what tells them apart.

    A run dir holds one run: the second job would be refused (another config) or would resume the
    first's run. The default subdir, `<condition>_s<seed>`, is shared when a sweep varies another key.
    """
    raw = str(container_dict(config.hydra.sweep, "hydra.sweep", resolve=False)["subdir"])
    # the default subdir is the plan's condition and seed; composing 40 jobs' configs to read it takes seconds
    by_subdir: dict[Any, list[PlannedJob]] = {}
    for job in jobs:
        key = (job.condition, job.seed) if raw == DEFAULT_SUBDIR else _subdir(config, job)
        if key is not None:
            by_subdir.setdefault(key, []).append(job)
    for shared in by_subdir.values():
        if len(shared) > 1:
            try:
                subdir = _job_subdir(config, shared[0])
            except COMPOSE_ERRORS as error:  # a typo in the key the sweep varies: the typo is the mistake
                raise ConfigError(f"job #{shared[0].num}: {compose_error_line(error)}") from None
            raise _shared_run_dir(config, raw, subdir, shared)


def _subdir(config: DictConfig, job: PlannedJob) -> str | None:
    """The job's run dir name; None when it needs what only the launch knows (`hydra.job.id`, the
    `hydra:` resolver), or when the job does not compose."""
    try:
        return _job_subdir(config, job)
    except (HydraException, OmegaConfBaseException):  # a job that does not compose fails at its launch, named
        return None


def _job_subdir(config: DictConfig, job: PlannedJob) -> str:
    """The job's run dir name as its launcher resolves it."""
    job_config = GlobalHydra.instance().config_loader().load_sweep_config(config, list(job.overrides))
    with read_write(job_config.hydra.job), open_dict(job_config.hydra.job):
        job_config.hydra.job.num = job.num  # as the launcher sets it (`job${hydra.job.num}`)
    return str(OmegaConf.select(job_config, "hydra.sweep.subdir", throw_on_missing=True))


def _shared_run_dir(config: DictConfig, raw: str, subdir: str, jobs: list[PlannedJob]) -> ConfigError:
    values: dict[str, set[str]] = {}
    for job in jobs:
        for override in job.overrides:
            key, _, value = override.lstrip("+~").partition("=")
            values.setdefault(key, set()).add(value)
    varied = [key for key, seen in values.items() if len(seen) > 1]
    choices = config.hydra.runtime.get("choices") or {}
    parts = "_".join(
        f"${{hydra:runtime.choices.{k}}}" if k in choices else f"{k.rsplit('.', 1)[-1]}${{{k}}}" for k in varied
    )
    numbers = ", ".join(f"#{job.num}" for job in jobs)
    shared = f"jobs {numbers} would share the run dir {subdir} (hydra.sweep.subdir={raw}), which holds one run"
    if not varied:
        return ConfigError(f"{shared}; their overrides are the same: the sweep lists a value twice")
    return ConfigError(
        f"{shared}; they differ in {', '.join(varied)}: name it in the subdir, e.g. hydra.sweep.subdir='{raw}_{parts}'"
    )


def _reshapes_algorithm(overrides: Sequence[str]) -> bool:
    """Whether the condition name depends on more than `algorithm=` (its parts or an explicit name)."""
    keys = (override.lstrip("+~").partition("=")[0] for override in overrides)
    return any(key.startswith(f"{CONDITION_KEY}/") or key == f"{CONDITION_KEY}.name" for key in keys)


def _composed_condition(config: DictConfig, overrides: Sequence[str]) -> str | None:
    """The job's `algorithm.name` as its run will derive it (e.g. `algorithm/advantage=rloo` renames it)."""
    job_config = GlobalHydra.instance().config_loader().load_sweep_config(config, list(overrides))
    name = OmegaConf.select(job_config, f"{CONDITION_KEY}.name")
    return None if name is None else str(name)


def _condition_and_seed(overrides: Sequence[str]) -> tuple[str | None, int | None]:
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
