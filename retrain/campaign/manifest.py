"""A sweep dir's manifest: what was planned, which run dir each job got, and where each run stands.

Written by the campaign callback (at the start, whenever a job starts or ends, at the end, and when
the driver exits for any reason) and re-derived on demand by `retrain status`. Everything is read
from files, because on SLURM every job is another process on another node.
"""

from __future__ import annotations

import fcntl
import os
import re
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from retrain.campaign.plan import PlannedJob, condition_label, condition_settings
from retrain.campaign.runs import RunInfo, process_alive, read_job, read_run, slurm_job_id, slurm_states
from retrain.errors import ConfigError
from retrain.housekeeping.rundir import RunDir, read_json, write_json_atomic

MANIFEST = "manifest.json"
SQUEEZE_FILE = "squeeze.json"
LOCK_FILE = ".campaign.lock"
SUBMITIT_DIR = ".submitit"
ALIVE_STATES = {"pending", "running", "stopped"}


@dataclass
class CampaignSettings:
    """How runs are compared; stored in the manifest so `retrain status` reports the same way."""

    baseline: str = "grpo_none"  # condition every other condition is tested against
    last_k: int = 10  # "last-k" scores average the last k steps of each run
    entropy_pair: list[str] = field(default_factory=lambda: ["maxrl_gtpo_sepa", "maxrl_gtpo_hicra"])
    confidence: float = 0.95

    def __post_init__(self) -> None:
        key = "hydra.callbacks.campaign"
        if not isinstance(self.baseline, str):
            raise ConfigError(f"{key}.baseline={self.baseline!r}: must name a condition")
        if isinstance(self.last_k, bool) or not isinstance(self.last_k, int) or self.last_k < 1:
            raise ConfigError(f"{key}.last_k={self.last_k!r}: must be an integer >= 1")
        if len(self.entropy_pair) != 2 or not all(isinstance(name, str) for name in self.entropy_pair):
            raise ConfigError(f"{key}.entropy_pair={self.entropy_pair!r}: must name exactly two conditions")
        if isinstance(self.confidence, bool) or not isinstance(self.confidence, (int, float)):
            raise ConfigError(f"{key}.confidence={self.confidence!r}: must be a number in (0, 1)")
        if not 0.0 < self.confidence < 1.0:
            raise ConfigError(f"{key}.confidence={self.confidence!r}: must be in (0, 1)")


@dataclass
class Campaign:
    """The live view of one sweep dir."""

    sweep_dir: Path
    settings: CampaignSettings
    plan: list[PlannedJob] | None
    runs: list[RunInfo]
    state: str
    driver: dict[str, Any]
    created_at: float | None
    launcher: str | None
    squeeze: dict[str, Any] | None
    squeeze_settings: dict[str, Any] | None

    @property
    def conditions(self) -> list[str]:
        return _unique([r.condition for r in self.runs if r.condition])

    @property
    def seeds(self) -> list[int]:
        return sorted(_unique([r.seed for r in self.runs if r.seed is not None]))

    def manifest(self) -> dict[str, Any]:
        return {
            "sweep_dir": str(self.sweep_dir),
            "state": self.state,
            "created_at": self.created_at,
            "updated_at": time.time(),
            "launcher": self.launcher,
            "driver": self.driver,
            "settings": asdict(self.settings),
            "conditions": self.conditions,
            "seeds": self.seeds,
            "counts": state_counts(self.runs),
            "plan": None if self.plan is None else [job.to_json() for job in self.plan],
            "runs": [run.brief() for run in self.runs],
            "squeeze_settings": self.squeeze_settings,
            "squeeze": self.squeeze,
        }


def _unique(values: list[Any]) -> list[Any]:
    return list(dict.fromkeys(values))


def state_counts(runs: list[RunInfo]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for run in runs:
        counts[run.state] = counts.get(run.state, 0) + 1
    return counts


@contextmanager
def sweep_lock(sweep_dir: Path) -> Iterator[None]:
    """Serialise writers of the sweep's shared files (jobs on SLURM end concurrently)."""
    sweep_dir.mkdir(parents=True, exist_ok=True)
    with open(sweep_dir / LOCK_FILE, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def start_manifest(
    sweep_dir: Path,
    plan: list[PlannedJob] | None,
    settings: CampaignSettings,
    launcher: str,
    squeeze_settings: dict[str, Any] | None,
) -> None:
    """The manifest before any job runs: the plan, the settings and who drives the sweep."""
    payload = {
        "sweep_dir": str(sweep_dir),
        "state": "running",
        "created_at": time.time(),
        "updated_at": time.time(),
        "launcher": launcher,
        "driver": {"pid": os.getpid(), "hostname": socket.gethostname()},
        "settings": asdict(settings),
        "plan": None if plan is None else [job.to_json() for job in plan],
        "runs": [],
        "squeeze_settings": squeeze_settings,
        "squeeze": None,
    }
    with sweep_lock(sweep_dir):
        write_json_atomic(sweep_dir / MANIFEST, payload)


def _job_num(run_dir: Path) -> int | None:
    files = RunDir(run_dir)
    job = read_job(run_dir)
    if isinstance(job.get("num"), int):
        return job["num"]
    try:
        hydra = yaml.safe_load((files.hydra_dir / "hydra.yaml").read_text())
        return int(hydra["hydra"]["job"]["num"])
    except (FileNotFoundError, KeyError, TypeError, ValueError, yaml.YAMLError):
        return None


def find_run_dirs(sweep_dir: Path) -> list[Path]:
    """Run dirs below the sweep dir (any depth, since hydra.sweep.subdir may nest)."""
    found = []
    for root, dirs, _ in os.walk(sweep_dir):
        path = Path(root)
        if path != sweep_dir and RunDir(path).has_run():
            found.append(path)
            dirs.clear()  # a run dir's own sub-dirs (checkpoints, wandb, ...) hold no runs
            continue
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
    return sorted(found)


def submitit_job_ids(sweep_dir: Path) -> dict[int, str]:
    """Array task -> SLURM job id, from submitit's folders (`.submitit/<array>_<task>/`)."""
    ids = {}
    for path in (sweep_dir / SUBMITIT_DIR).glob("*_*"):
        match = re.fullmatch(r"(\d+)_(\d+)", path.name)
        if match and path.is_dir():
            ids[int(match.group(2))] = path.name
    return ids


def collect(sweep_dir: Path, driver_exiting: bool = False) -> Campaign:
    """Read the manifest's static part and every run dir; resolve each run's state.

    `driver_exiting`: the driver itself collects as it ends, still alive but launching nothing more."""
    sweep_dir = sweep_dir.resolve()
    manifest = read_json(sweep_dir / MANIFEST) or {}
    if not isinstance(manifest, dict):
        raise ValueError(f"{MANIFEST} holds a {type(manifest).__name__}, not an object")
    settings = CampaignSettings(**manifest.get("settings", {}))
    plan = [PlannedJob(**job) for job in manifest["plan"]] if manifest.get("plan") is not None else None
    run_dirs = find_run_dirs(sweep_dir)
    queued = submitit_job_ids(sweep_dir)
    jobs = [read_job(d) for d in run_dirs]
    ids = [i for i in (slurm_job_id(job) for job in jobs) if i] + list(queued.values())
    cluster = slurm_states(sorted(set(ids))) if ids else {}
    runs_by_num: dict[int, RunInfo] = {}
    unnumbered: list[RunInfo] = []
    for run_dir in run_dirs:
        run = read_run(run_dir, cluster)
        num = _job_num(run_dir)
        if num is None or num in runs_by_num:
            unnumbered.append(run)
        else:
            runs_by_num[num] = run
    driver = manifest.get("driver") or {}
    driver_alive = False if driver_exiting else process_alive(driver.get("hostname"), driver.get("pid"))
    runs: list[RunInfo] = []
    overrides: list[list[str] | None] = []
    for job in plan or []:
        started = runs_by_num.pop(job.num, None)
        if started is None:
            started = _not_started(sweep_dir, job, driver_alive, cluster.get(queued.get(job.num, "")))
        runs.append(started)
        overrides.append(job.overrides)
    for run in [runs_by_num[num] for num in sorted(runs_by_num)] + unnumbered:
        runs.append(run)
        recorded = run.job.get("overrides")
        overrides.append([str(o) for o in recorded] if isinstance(recorded, list) else None)
    label_conditions(runs, overrides)
    return Campaign(
        sweep_dir=sweep_dir,
        settings=settings,
        plan=plan,
        runs=runs,
        state=sweep_state(runs, driver_alive),
        driver={**driver, "alive": driver_alive},
        created_at=manifest.get("created_at"),
        launcher=manifest.get("launcher"),
        squeeze=squeeze if isinstance(squeeze := read_json(sweep_dir / SQUEEZE_FILE), dict) else None,
        squeeze_settings=manifest.get("squeeze_settings"),
    )


def label_conditions(runs: list[RunInfo], overrides: list[list[str] | None]) -> None:
    """Make each run's condition every swept setting but the seed: its algorithm and, when the sweep varies
    more (`training.lr=1e-3,1e-4`), those values too, so that statistics pool seeds of one condition only.
    `overrides`: each run's job overrides (from the plan or its job.json); None where unknown."""
    known = [(run, job) for run, job in zip(runs, overrides) if job is not None]
    settings = condition_settings([job for _, job in known])
    for (run, _), setting in zip(known, settings):
        run.algorithm, run.settings = run.condition, setting
        run.condition = condition_label(run.condition, setting)
        if run.dir is None and setting:  # a job not started yet: named as the default subdir will name it
            run.name += "_" + "_".join(f"{key.rsplit('.', 1)[-1]}{value}" for key, value in setting.items())
    for run, job in zip(runs, overrides):
        if job is None:
            run.algorithm = run.condition


def _not_started(sweep_dir: Path, job: PlannedJob, driver_alive: bool | None, cluster_state: str | None) -> RunInfo:
    """A planned job without a run dir: pending while something will still start it, else missing."""
    if cluster_state is not None:
        alive = cluster_state in ("PENDING", "RUNNING", "REQUEUED", "CONFIGURING")
    else:
        alive = driver_alive is not False
    name = f"{job.condition}_s{job.seed}" if job.condition and job.seed is not None else f"job{job.num}"
    return RunInfo(
        dir=None,
        name=name,
        condition=job.condition,
        seed=job.seed,
        state="pending" if alive else "missing",
        job={"num": job.num, "overrides": job.overrides},
        error=None if alive else "never started: its launcher is gone",
    )


def sweep_state(runs: list[RunInfo], driver_alive: bool | None = None) -> str:
    """running (something alive) / done (every run done) / partial (some done) / dead (none done)."""
    if any(run.state in ALIVE_STATES for run in runs) or (not runs and driver_alive):
        return "running"
    if runs and all(run.state == "done" for run in runs):
        return "done"
    return "partial" if any(run.state == "done" for run in runs) else "dead"


def write_manifest(campaign: Campaign) -> None:
    write_json_atomic(campaign.sweep_dir / MANIFEST, campaign.manifest())
