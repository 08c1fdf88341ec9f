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


def overrides_by_key(overrides: Sequence[str]) -> dict[str, str]:
    """`key=value` overrides as {key: value}, the key without its `+`/`~`/`++` prefix."""
    pairs = (override.lstrip("+~").partition("=") for override in overrides)
    return {key: value for key, _, value in pairs}


def swept_keys(jobs_overrides: Sequence[Sequence[str]]) -> list[str]:
    """The keys whose value differs between jobs (a key some jobs lack too), in the order they first appear."""
    by_job = [overrides_by_key(overrides) for overrides in jobs_overrides]
    keys = dict.fromkeys(key for job in by_job for key in job)
    return [key for key in keys if len({job.get(key) for job in by_job}) > 1]


def setting_keys(keys: Sequence[str]) -> list[str]:
    """Of the swept keys, those that belong to a condition beside its algorithm (whose name it carries
    already, `algorithm/...` parts included) and that are not the seed (which repeats a condition)."""
    return [
        key
        for key in keys
        if key != SEED_KEY
        and key != f"{CONDITION_KEY}.name"
        and key.partition("/")[0] != CONDITION_KEY
        and not key.startswith(("hydra.", "hydra/"))
    ]


def condition_settings(jobs_overrides: Sequence[Sequence[str]]) -> list[dict[str, str]]:
    """Per job, its values of the swept settings that make a condition besides the algorithm: with
    `training.lr=1e-3,1e-4` the two rates are two conditions, never two seeds of one."""
    keys = setting_keys(swept_keys(jobs_overrides))
    by_job = [overrides_by_key(overrides) for overrides in jobs_overrides]
    return [{key: job.get(key, "") for key in keys} for job in by_job]


def condition_label(algorithm: str | None, settings: dict[str, str]) -> str | None:
    """`maxrl_gtpo_sepa training.lr=1e-3`: the algorithm's name and the condition's other swept settings."""
    if algorithm is None or not settings:
        return algorithm
    return " ".join([algorithm, *(f"{key}={value}" for key, value in settings.items())])


def swept_subdir(config: DictConfig, jobs: list[PlannedJob]) -> str | None:
    """The default subdir with every other swept key named too (`..._s${training.seed}_lr${training.lr}`);
    None when the sweep varies nothing but the algorithm and the seed."""
    keys = setting_keys(swept_keys([job.overrides for job in jobs]))
    if not keys:
        return None
    return f"{DEFAULT_SUBDIR}_{_name_parts(config, keys)}"


def name_swept_keys_in_subdir(config: DictConfig, jobs: list[PlannedJob]) -> str | None:
    """With the default `hydra.sweep.subdir`, a sweep of more keys than algorithm and seed gets them in its
    run dirs' names (`swept_subdir`), so an lr or beta sweep needs no hand-written subdir. Set on the launch's
    config and added to its Hydra overrides, from which every job's config is composed (on a cluster node
    too). Returns the subdir it set, None when it left the subdir as it was."""
    raw = str(container_dict(config.hydra.sweep, "hydra.sweep", resolve=False)["subdir"])
    subdir = swept_subdir(config, jobs) if raw == DEFAULT_SUBDIR else None
    if subdir is None:
        return None
    with read_write(config.hydra), open_dict(config.hydra):
        config.hydra.sweep.subdir = subdir
        config.hydra.overrides.hydra.append(f"hydra.sweep.subdir={subdir}")
    return subdir


def check_first_job_composes(config: DictConfig, jobs: list[PlannedJob]) -> None:
    """ConfigError naming the job when the first planned job's config does not compose: a typo in a key the sweep
    varies (`trainig.lr=1e-3,1e-4`) is the same typo in every job, found here before any starts (one compose)."""
    if not jobs:
        return
    try:
        GlobalHydra.instance().config_loader().load_sweep_config(config, list(jobs[0].overrides))
    except COMPOSE_ERRORS as error:
        raise ConfigError(f"job #{jobs[0].num}: {compose_error_line(error)}") from None


def check_run_dirs_apart(config: DictConfig, jobs: list[PlannedJob]) -> None:
    """ConfigError when two planned jobs would share a run dir (`hydra.sweep.subdir`), naming what tells them apart.

    A run dir holds one run: the second job would be refused (another config) or would resume the
    first's run. The default subdir, `<condition>_s<seed>`, is shared when a sweep varies another key
    and the subdir was not extended to name it (`name_swept_keys_in_subdir`).
    """
    raw = str(container_dict(config.hydra.sweep, "hydra.sweep", resolve=False)["subdir"])
    settings = condition_settings([job.overrides for job in jobs])
    # the default subdirs name the plan's condition, seed (and swept values): composing 40 jobs' configs takes seconds
    named_by_plan = raw == swept_subdir(config, jobs)
    by_subdir: dict[Any, list[PlannedJob]] = {}
    for job, setting in zip(jobs, settings):
        if raw == DEFAULT_SUBDIR:
            key: Any = (job.condition, job.seed)
        elif named_by_plan:
            key = (job.condition, job.seed, *setting.values())
        else:
            key = _subdir(config, job)
        if key is not None:
            by_subdir.setdefault(key, []).append(job)
    for shared in by_subdir.values():
        if len(shared) > 1:
            try:
                subdir = _job_subdir(config, shared[0])
            except COMPOSE_ERRORS as error:  # a typo in the key the sweep varies: the typo is the mistake
                raise ConfigError(f"job #{shared[0].num}: {compose_error_line(error)}") from None
            raise shared_run_dir(config, raw, subdir, shared)


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


def shared_run_dir(config: DictConfig, raw: str, subdir: str, jobs: Sequence[PlannedJob]) -> ConfigError:
    """The error of jobs that would share the run dir `subdir`: the keys they differ in, and a subdir naming them."""
    varied = swept_keys([job.overrides for job in jobs])
    numbers = ", ".join(f"#{job.num}" for job in jobs)
    shared = f"jobs {numbers} would share the run dir {subdir} (hydra.sweep.subdir={raw}), which holds one run"
    if not varied:
        return ConfigError(f"{shared}; their overrides are the same: the sweep lists a value twice")
    return ConfigError(
        f"{shared}; they differ in {', '.join(varied)}: name it in the subdir, "
        f"e.g. hydra.sweep.subdir='{raw}_{_name_parts(config, varied)}'"
    )


def _name_parts(config: DictConfig, keys: Sequence[str]) -> str:
    """`lr${training.lr}` per key (a config group: the option chosen), joined by `_`: a run dir name's part."""
    choices = config.hydra.runtime.get("choices") or {}
    return "_".join(
        f"${{hydra.runtime.choices.{k}}}" if k in choices else f"{k.rsplit('.', 1)[-1]}${{{k}}}" for k in keys
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
