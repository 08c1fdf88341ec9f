"""`retrain explain [overrides…] [-m] [--json] [--pilot RUN_DIR]`: what a run or a sweep would do, loading no model.

    retrain explain                                              # the default run
    retrain explain backend=tinker algorithm=grpo_none           # any overrides `python -m retrain` takes
    retrain explain -m algorithm=grpo_none,maxrl_gtpo_sepa training.seed=1,2
    retrain explain -m +campaign=ablation --pilot outputs/runs/2025-01-01/12-00-00_maxrl_gtpo_sepa

For each condition (every swept setting but the seed, named as the sweep's summary names it:
retrain.campaign.plan.condition_label): the composed parts and their `_target_`s, the algorithm's label, the backend's
capabilities and where they come from, the algorithm's preflight on a synthetic step (exit 1 with its
message when it fails), whether planning detection and SEPA are used; split mode on a launch of several ranks is
refused as the run refuses it (exit 1). For the run or every run of the
sweep (Hydra's job order, retrain.campaign.plan): its run dir and wandb group, the estimate of
wall time and GPU hours (retrain/commands/capacity.py, docs/capacity-planning.md), and for a local backend
its memory plan (retrain/model/memory_plan.py) with the GPU sizes it fits and with which knob.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import InterpolationKeyError, OmegaConfBaseException

from retrain.commands.capacity import (
    REFERENCE_GPU,
    REFERENCE_STEP_S,
    Pilot,
    Workload,
    read_pilot,
    run_estimate,
    step_time,
)
from retrain.commands.capacity import wall_hours as campaign_wall_hours
from retrain.config_checks.compose_errors import config_mistake
from retrain.distributed.rendezvous import check_one_device_per_rank, planned_local_ranks, planned_world_size
from retrain.errors import ConfigError
from retrain.model.memory_plan import GIB, memory_report

PART_GROUPS = ("backend", "model", "algorithm", "inference", "reward", "data")
SEQUENTIAL_LAUNCHERS = ("BasicLauncher",)  # Hydra's default runs the jobs one after another


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="retrain explain",
        description="A dry run: what `python -m retrain <overrides>` would do, and how long it would take. "
        "Loads no model.",
    )
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as `python -m retrain` takes them")
    parser.add_argument("-m", "--multirun", action="store_true", help="explain the sweep `--multirun` would launch")
    parser.add_argument("--json", action="store_true", help="print the machine-readable report")
    parser.add_argument("--pilot", type=Path, help="a run dir whose median step time replaces the reference")
    parser.add_argument(
        "--gpu",
        choices=sorted(REFERENCE_STEP_S),
        help="the reference GPU row of the estimate (default: this machine's GPU if the table has it, else h100)",
    )
    parser.add_argument("--config-dir", type=Path, help="a config dir of your own, searched too (as for retrain)")
    args = parser.parse_args(argv)
    try:
        report = explain(args.overrides, args.multirun, args.config_dir, args.pilot, args.gpu)
    except Exception as error:
        mistake = config_mistake(error)
        if mistake is None:
            raise
        print(f"retrain explain: {mistake}", file=sys.stderr)
        return 1
    from retrain.housekeeping.secrets import masked_values

    report = masked_values(report)  # a key typed on the command line, a url's credentials: never shown
    print(json.dumps(report, indent=2, default=str) if args.json else render(report))
    failures = [
        f"{check.replace('_', ' ')} failed: {c[check]['error']}"
        for c in report["conditions"]
        for check in ("preflight", "backend_options")
        if not c[check]["ok"]
    ]
    for failure in dict.fromkeys(failures):
        print(f"retrain explain: {failure}", file=sys.stderr)
    return 1 if failures else 0


# ---- composing -------------------------------------------------------------------------------------


def search_path_overrides(config_dir: Path | None) -> list[str]:
    """A user's config dir as an override (what `--config-dir` does for `python -m retrain`)."""
    if config_dir is None:
        return []
    if not config_dir.is_dir():
        raise ConfigError(f"--config-dir {config_dir}: no such directory")
    return [f"hydra.searchpath=[file://{config_dir.resolve()}]"]


def composed(overrides: list[str], config_dir: Path | None = None) -> DictConfig:
    """The config `python -m retrain [--config-dir DIR] <overrides>` would run, `hydra` node included."""
    from retrain.config import compose

    return compose(search_path_overrides(config_dir) + overrides, return_hydra_config=True)


def checked_config(cfg: DictConfig) -> None:
    """The checks a run makes before it builds anything (retrain.run.run), and the imports of the parts a run
    builds but explain does not: a typo in their `_target_` shows here, not only when the run gets there."""
    from retrain.config_checks.validation import check_run_config
    from retrain.run import target_object

    run_config = without_hydra(cfg)
    check_run_config(run_config)
    for group in ("reward", "data"):
        if OmegaConf.select(run_config, f"{group}._target_") is not None:
            target_object(run_config, group)


def without_hydra(cfg: DictConfig) -> DictConfig:
    """The run's own config: what `python -m retrain` hands the run (the `hydra` node left out)."""
    return OmegaConf.masked_copy(cfg, [str(key) for key in cfg if key != "hydra"])


def plain(cfg: DictConfig) -> dict[str, Any]:
    """The run's config resolved, as plain containers."""
    container = OmegaConf.to_container(without_hydra(cfg), resolve=True)
    assert isinstance(container, dict)
    return {str(key): value for key, value in container.items()}


def split_sweeps(overrides: list[str]) -> tuple[list[str], list[str]]:
    """(overrides that sweep, the others), parsed the way Hydra parses them."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    sweeps = [str(o.input_line) for o in parsed if o.is_sweep_override()]
    return sweeps, [str(o.input_line) for o in parsed if not o.is_sweep_override()]


@dataclass
class Job:
    num: int
    overrides: list[str]
    config: DictConfig


def planned_jobs(overrides: list[str], multirun: bool, config_dir: Path | None) -> tuple[list[Job], DictConfig]:
    """Every job in Hydra's order with its composed config, and the config of the launch itself."""
    from retrain.campaign.plan import expand, name_swept_keys_in_subdir
    from retrain.housekeeping.secrets import masked_override

    sweeps, fixed = split_sweeps(overrides)
    if sweeps and not multirun:
        raise ConfigError(f"{' '.join(sweeps)} sweeps: add -m (--multirun), as `python -m retrain` needs")
    launch = composed(fixed, config_dir)
    if not multirun:
        return [Job(0, overrides, launch)], launch
    sweeper = str(launch.hydra.sweeper.get("_target_", ""))
    if not sweeper.endswith("BasicSweeper"):
        raise ConfigError(
            f"hydra/sweeper={sweeper}: its jobs are known only as it runs; explain plans the basic sweeper"
        )
    params = launch.hydra.sweeper.get("params") or {}
    arguments = [f"{key}={value}" for key, value in params.items()] + [masked_override(o) for o in overrides]
    plan = expand(arguments)
    # as the launch does (retrain.campaign.callbacks): the default subdir names every swept key
    named = name_swept_keys_in_subdir(launch, plan)
    subdir = [] if named is None else [f"hydra.sweep.subdir={named}"]
    return [Job(job.num, job.overrides, composed([*job.overrides, *subdir], config_dir)) for job in plan], launch


def check_run_dirs_apart(jobs: list[Job], run_dirs: list[str], launch: DictConfig) -> None:
    """The launch's refusal of jobs that would share a run dir (retrain.campaign.plan), from the run dirs
    explained; one only the launcher resolves (`${hydra.job.num}`) is the launcher's to keep apart."""
    from retrain.campaign.plan import PlannedJob, shared_run_dir
    from retrain.config import container_dict

    by_dir: dict[str, list[Job]] = {}
    for job, where in zip(jobs, run_dirs):
        if "${" not in where:
            by_dir.setdefault(where, []).append(job)
    raw = str(container_dict(launch.hydra.sweep, "hydra.sweep", resolve=False)["subdir"])
    for where, shared in by_dir.items():
        if len(shared) > 1:
            planned = [PlannedJob(job.num, job.overrides, None, None) for job in shared]
            raise shared_run_dir(launch, raw, Path(where).name, planned)


# ---- one condition: parts, backend, preflight ----------------------------------------------------


def targets(node: Any, prefix: str) -> dict[str, str]:
    """Every `_target_` under a config node, by the dotted key of the node that names it."""
    found: dict[str, str] = {}
    if isinstance(node, dict):
        if isinstance(node.get("_target_"), str):
            found[prefix] = node["_target_"]
        for key, value in node.items():
            found.update(targets(value, f"{prefix}.{key}"))
    return found


def describe_condition(cfg: DictConfig) -> dict[str, Any]:
    """What one composed config is made of, and whether its algorithm can run on its backend and engine."""
    from retrain.run import plan_parts

    container = plain(cfg)
    choices = OmegaConf.to_container(cfg.hydra.runtime.choices)
    assert isinstance(choices, dict)
    parts = {
        group: {
            "option": choices.get(group),
            "_target_": container[group].get("_target_"),
            "targets": targets(container[group], group),
        }
        for group in PART_GROUPS
    }
    plan = plan_parts(cfg)
    algorithm, backend, engine_cls = plan.algorithm, plan.backend, plan.engine_cls
    capabilities = backend.capabilities
    described = algorithm.describe() if hasattr(algorithm, "describe") else {}
    try:
        probe = plan.preflight()
        checked: dict[str, Any] = {"ok": True, "error": None, **asdict(probe)}
    except ConfigError as error:
        checked = {"ok": False, "error": str(error)}
    try:
        plan.check_options()
        options: dict[str, Any] = {"ok": True, "error": None}
    except ConfigError as error:
        options = {"ok": False, "error": str(error)}
    return {
        "name": algorithm.name,
        "label": algorithm.label,
        "parts": parts,
        "algorithm": described,
        "backend": backend.as_dict(),
        "engine": {
            "target": f"{engine_cls.__module__}.{engine_cls.__qualname__}",
            "used": not capabilities.samples_itself,  # a backend that samples itself ignores `inference=`
            "returns_entropies": bool(getattr(engine_cls, "returns_entropies", False)),
        },
        "preflight": checked,
        "backend_options": options,
        "planning_detection": bool(algorithm.needs_planning),
        "sepa": bool(described.get("uses_sepa", False)),
    }


# ---- the run matrix and the estimate ---------------------------------------------------------------


UNSET_VARIABLE = "KeyError raised while resolving interpolation"  # OmegaConf's words for `${oc.env:UNSET}`


def resolved(cfg: DictConfig, key: str) -> str:
    """A `hydra.*` path as this launch resolves it; as written when it needs what only a launcher sets.
    An interpolation the run cannot resolve either (a key or an environment variable that does not
    exist) raises, and is reported as the run would report it."""
    try:
        return str(OmegaConf.select(cfg, key, throw_on_resolution_failure=True))
    except OmegaConfBaseException as error:  # e.g. `${hydra.job.num}` in a subdir: set per job by the launcher
        if isinstance(error, InterpolationKeyError) or str(error).startswith(UNSET_VARIABLE):
            raise
        from retrain.config import container_dict

        parent, _, leaf = key.rpartition(".")
        return str(container_dict(OmegaConf.select(cfg, parent), parent, resolve=False)[leaf])


def run_dir(job: Job, launch: DictConfig, multirun: bool) -> str:
    if not multirun:
        return resolved(job.config, "hydra.run.dir")
    return str(Path(resolved(launch, "hydra.sweep.dir")) / resolved(job.config, "hydra.sweep.subdir"))


def wandb_of(cfg: DictConfig) -> dict[str, Any]:
    logging = cfg.logging
    return {
        "enabled": bool(logging.wandb_project),
        "project": logging.wandb_project or None,
        "entity": logging.wandb_entity or None,
        "group": logging.wandb_group or None,
        "name": logging.wandb_run_name or None,
        "tags": list(logging.wandb_tags),
    }


def detected_gpu() -> str | None:
    """This machine's GPU as a reference row, if torch sees one the table has."""
    from retrain.commands.capacity import gpu_kind

    try:
        import torch

        return gpu_kind(torch.cuda.get_device_name(0)) if torch.cuda.is_available() else None
    except (ImportError, RuntimeError):
        return None


def eval_completions(container: dict[str, Any]) -> int:
    """Completions one held-out evaluation samples: greedy and `eval.samples` sampled per problem (0 when off)."""
    evaluation = container["eval"]
    return int(evaluation["num_examples"]) * (1 + int(evaluation["samples"])) if evaluation["num_examples"] > 0 else 0


def launcher_parallelism(launch: DictConfig, jobs: int) -> tuple[str, int]:
    """(launcher, how many runs it runs at once): one for Hydra's basic launcher, else its array_parallelism."""
    target = str(launch.hydra.launcher.get("_target_", ""))
    name = target.rsplit(".", 1)[-1]
    if name in SEQUENTIAL_LAUNCHERS:
        return name, 1
    return name, min(jobs, int(launch.hydra.launcher.get("array_parallelism") or jobs))


def explain(
    overrides: list[str],
    multirun: bool = False,
    config_dir: Path | None = None,
    pilot_dir: Path | None = None,
    gpu: str | None = None,
) -> dict[str, Any]:
    """The whole report (what `--json` prints)."""
    from retrain.campaign.plan import condition_label, condition_settings

    jobs, launch = planned_jobs(overrides, multirun, config_dir)
    pilot: Pilot | None = read_pilot(pilot_dir) if pilot_dir is not None else None
    gpu = gpu or detected_gpu() or REFERENCE_GPU
    described: dict[str, dict[str, Any]] = {}  # per composed shape: describing one plans its parts
    conditions: dict[str | None, dict[str, Any]] = {}  # per condition, named as the sweep's summary names it
    runs = []
    notes: list[str] = []
    settings = condition_settings([job.overrides for job in jobs])  # a condition: every swept setting but the seed
    ranks_by = launch.hydra.launcher if multirun else {}  # a submitit launcher's tasks, else torchrun's variables
    world_size, local_ranks = planned_world_size(ranks_by), planned_local_ranks(ranks_by)
    for job, setting in zip(jobs, settings):
        checked_config(job.config)
        check_one_device_per_rank(str(OmegaConf.select(job.config, "backend.devices", default="cpu")), world_size)
        container = plain(job.config)
        shape = json.dumps([container[group] for group in ("algorithm", "backend", "inference")], sort_keys=True)
        if shape not in described:
            described[shape] = describe_condition(job.config)
        condition = condition_label(described[shape]["name"], setting)
        if condition not in conditions:
            conditions[condition] = {"condition": condition, **described[shape], "runs": 0}
        conditions[condition]["runs"] += 1
        workload = Workload.of(container)
        timing = step_time(workload, gpu, pilot)
        notes += [note for note in timing.notes if note not in notes]
        runs.append(
            {
                "memory": memory_report(container, local_ranks),
                "num": job.num,
                "overrides": job.overrides,
                "condition": condition,
                "seed": container["training"]["seed"],
                "run_dir": run_dir(job, launch, multirun),
                "wandb": wandb_of(job.config),
                "max_steps": container["training"]["max_steps"],
                "world_size": world_size,
                "workload": asdict(workload),
                "estimate": {
                    **run_estimate(
                        timing.seconds, job.config.training.max_steps, workload, eval_completions(container)
                    ).as_dict(),
                    "source": timing.source,
                },
            }
        )
    if multirun:
        check_run_dirs_apart(jobs, [run["run_dir"] for run in runs], launch)
    launcher, parallel = launcher_parallelism(launch, len(runs)) if multirun else ("single run", 1)
    hours = [run["estimate"]["hours"] for run in runs]
    gpu_hours = [run["estimate"]["gpu_hours"] for run in runs]
    known = all(h is not None for h in hours)
    return {
        "overrides": overrides,
        "multirun": multirun,
        "sweep_dir": resolved(launch, "hydra.sweep.dir") if multirun else None,
        "conditions": list(conditions.values()),
        "runs": runs,
        "estimate": {
            "reference_gpu": gpu,
            "pilot": None
            if pilot is None
            else {**asdict(pilot), "workload": pilot.workload and asdict(pilot.workload)},
            "launcher": launcher,
            "parallel_runs": parallel,
            "runs": len(runs),
            "total_run_hours": sum(hours) if known else None,
            "wall_hours": campaign_wall_hours(hours, parallel) if known else None,
            "gpu_hours": sum(gpu_hours) if all(g is not None for g in gpu_hours) else None,
            "notes": notes,
        },
    }


# ---- the text report ------------------------------------------------------------------------------


def _hours(value: float | None) -> str:
    if value is None:
        return "unknown"
    return f"{value * 60:.1f} min" if value < 1 else f"{value:.1f} h"


def _overhead(estimate: dict[str, Any]) -> str:
    """What a run's time holds besides its steps: start-up, model load and the held-out evaluation."""
    if estimate["hours"] is None:
        return ""
    parts = f"start-up {estimate['startup_s']:.0f} s, model load {estimate['model_load_s']:.0f} s"
    return f" (with {parts}, evaluation {estimate['eval_s']:.0f} s)"


def render(report: dict[str, Any]) -> str:
    lines = []
    for condition in report["conditions"]:
        backend, caps = condition["backend"], condition["backend"]["capabilities"]
        lines.append(f"Condition {condition['condition']} [{condition['label']}] ({condition['runs']} run(s))")
        for group, part in condition["parts"].items():
            option = f"{group}={part['option']}" if part["option"] else group
            lines.append(f"  {option:<28} {part['_target_']}")
            lines += [f"    {key:<26} {target}" for key, target in part["targets"].items() if key != group]
        flags = " ".join(f"{key}={value}" for key, value in caps.items())
        lines.append(f"  backend {backend['name']} (source={backend['source']}): {flags}")
        engine = condition["engine"]
        lines.append(f"  engine {engine['target']}" + ("" if engine["used"] else " (not used: the backend samples)"))
        lines.append(
            f"  planning detection: {'yes' if condition['planning_detection'] else 'no'}; "
            f"SEPA: {'yes' if condition['sepa'] else 'no'}"
        )
        preflight = condition["preflight"]
        if preflight["ok"]:
            lines.append(f"  preflight: ok (token-varying advantages: {'yes' if preflight['token_varying'] else 'no'})")
        else:
            lines.append(f"  preflight: FAILED: {preflight['error']}")
        if not condition["backend_options"]["ok"]:
            lines.append(f"  backend options: FAILED: {condition['backend_options']['error']}")
    estimate = report["estimate"]
    lines.append("")
    if report["multirun"]:
        lines.append(
            f"Sweep: {len(report['runs'])} run(s) in {report['sweep_dir']} ({estimate['launcher']}, "
            f"{estimate['parallel_runs']} at a time)"
        )
    for run in report["runs"]:
        wandb = run["wandb"]
        where = (
            f"wandb {wandb['project']}/{wandb['group'] or '-'}/{wandb['name'] or '-'}"
            if wandb["enabled"]
            else (f"wandb off (group would be {wandb['group']})" if wandb["group"] else "wandb off")
        )
        step = run["estimate"]["step_time_s"]
        timing = "step ? s" if step is None else f"step {step:.2f} s"
        seed = "drawn at start" if run["seed"] == -1 else run["seed"]
        lines.append(
            f"  #{run['num']} {run['condition']} seed={seed} {run['max_steps']} steps, world size {run['world_size']}, {timing}, "
            f"{_hours(run['estimate']['hours'])}{_overhead(run['estimate'])}  {run['run_dir']}  {where}"
        )
    lines += render_memory(report["runs"])
    pilot = estimate["pilot"]
    on_cpu = {run["estimate"]["source"] for run in report["runs"]} == {"reference:cpu"}
    source = (
        f"pilot {pilot['run_dir']}: median step {pilot['median_step_time_s']:.2f} s over {pilot['steps']} steps"
        if pilot
        else ("reference: the quickstart on 2 CPU cores" if on_cpu else f"reference: one {estimate['reference_gpu']}")
    )
    gpu_hours = "unknown" if estimate["gpu_hours"] is None else f"{estimate['gpu_hours']:.1f}"
    lines.append(
        f"Estimate ({source}): wall time {_hours(estimate['wall_hours'])}, GPU hours {gpu_hours} "
        "(docs/capacity-planning.md)"
    )
    lines += [f"  note: {note}" for note in estimate["notes"]]
    return "\n".join(lines)


def render_memory(runs: list[dict[str, Any]]) -> list[str]:
    """Each distinct memory plan of the runs, with the GPU sizes it fits and what makes it fit."""
    lines: list[str] = []
    shown: set[str] = set()
    for run in runs:
        memory = run["memory"]
        if memory is None or memory["table"] in shown:
            continue
        shown.add(memory["table"])
        lines.append(f"Memory on {memory['shown_on']} (docs/capacity-planning.md, Memory):")
        lines += [f"  {line}" for line in memory["table"].splitlines()]
        if memory["gpu_sizes"]:
            lines.append("  GPU sizes:")
        for size, fit in memory["gpu_sizes"].items():
            if fit["fits"]:
                how = f"fits: checkpointing {'on' if fit['gradient_checkpointing'] else 'off'}, KV budget "
                how += f"{fit['kv_budget_bytes'] / GIB:.1f} GiB ({fit['rows_at_once']} rows at full length at once)"
            else:
                how = f"does not fit: {fit['problem']}"
            lines.append(f"    {size:>4} GB: {how}")
    return lines
