"""What one run dir says about its run, read only from files (the run may live in another process,
on another node, or be dead): status.json and metrics.jsonl (the trainer's), job.json and exit.json
(the campaign callback's), .hydra/ (Hydra's).

A run's state is one of:
  pending  planned, not started             running  alive and training
  stopped  pre-empted, checkpointed, waiting for its requeue (or, outside a cluster, for a restart)
  done     finished all steps                failed   raised an error (see `error`)
  dead     says running/stopped, but its process or cluster job is gone
  unknown  a bare run dir (no status.json, no job.json): nothing to ask
  unreadable  its files hold something else than a run writes (damaged, or not a run's): see `error`
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from retrain.config import register_resolvers
from retrain.housekeeping.rundir import EXIT_FILE, JOB_FILE, STATUS_FILE, RunDir

SLURM_ALIVE = {
    "PENDING",
    "RUNNING",
    "REQUEUED",
    "REQUEUE_HOLD",
    "REQUEUE_FED",
    "RESIZING",
    "SUSPENDED",
    "CONFIGURING",
    "COMPLETING",
    "SIGNALING",
    "STAGE_OUT",
    "STOPPED",
}
UNREADABLE = "unreadable"


@dataclass
class RunInfo:
    """Everything a campaign report needs about one run."""

    dir: Path | None  # None for a planned job that has not started
    name: str
    condition: str | None
    seed: int | None
    state: str
    step: int = -1  # last completed step (0-based); -1 before the first
    max_steps: int | None = None
    error: str | None = None
    updated_at: float | None = None
    job: dict[str, Any] = field(default_factory=dict)
    exit: dict[str, Any] | None = None
    metrics: list[dict[str, Any]] = field(default_factory=list, repr=False)
    eval: dict[str, Any] = field(default_factory=dict)  # held-out accuracy recorded in status.json
    # in a sweep: the algorithm's name, and the other swept settings (the seed aside) that with it make the
    # condition; `condition` is then the label of both (retrain.campaign.plan.condition_label)
    algorithm: str | None = None
    settings: dict[str, str] = field(default_factory=dict)

    @property
    def has_adapter(self) -> bool:
        return self.dir is not None and RunDir(self.dir).final_adapter.is_file()

    def brief(self) -> dict[str, Any]:
        """The manifest's view of the run (no per-step records)."""
        return {
            "name": self.name,
            "dir": None if self.dir is None else str(self.dir),
            "condition": self.condition,
            "algorithm": self.algorithm,
            "settings": self.settings,
            "seed": self.seed,
            "state": self.state,
            "step": self.step,
            "max_steps": self.max_steps,
            "error": self.error,
            "updated_at": self.updated_at,
            "num_metrics": len(self.metrics),
            "has_adapter": self.has_adapter,
            "job": self.job,
            "exit": self.exit,
        }


def process_alive(hostname: str | None, pid: int | None) -> bool | None:
    """True/False for a process on this host; None when it runs elsewhere (cannot tell from here)."""
    if not pid or hostname != socket.gethostname():
        return None
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True


def slurm_states(job_ids: list[str]) -> dict[str, str]:
    """SLURM's state of each job id (array tasks as `123_4`) from accounting; {} without `sacct`."""
    if not job_ids or shutil.which("sacct") is None:
        return {}
    try:
        out = subprocess.run(
            ["sacct", "-n", "-X", "-P", "-o", "JobID,State", "-j", ",".join(job_ids)],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (subprocess.SubprocessError, OSError):
        return {}
    states = {}
    for line in out.splitlines():
        if "|" in line:
            job_id, state = line.split("|", 1)
            states[job_id.strip()] = state.split()[0] if state.strip() else "UNKNOWN"
    return states


def slurm_job_id(job: dict[str, Any]) -> str | None:
    slurm = job.get("slurm") or {}
    if not isinstance(slurm, dict):  # a damaged job.json: no job to ask about
        return None
    if slurm.get("array_job_id") and slurm.get("array_task_id") is not None:
        return f"{slurm['array_job_id']}_{slurm['array_task_id']}"
    return slurm.get("job_id")


def resolve_state(
    recorded: str | None, process: dict[str, Any], exit_info: dict[str, Any] | None, cluster_state: str | None
) -> str:
    """Combine what the run wrote with whether its process (hostname, pid) or cluster job still exists."""
    if exit_info is not None and exit_info.get("status") == "failed" and recorded != "done":
        return "failed"
    if recorded in ("done", "failed"):
        return recorded
    if cluster_state is not None:
        alive: bool | None = cluster_state in SLURM_ALIVE
    else:
        alive = process_alive(process.get("hostname"), process.get("pid"))
    if recorded == "stopped":
        if cluster_state is None and alive is False:
            return "stopped"  # SIGTERM or Ctrl-C outside a cluster: checkpointed, resumes when started again
        return "running" if alive and cluster_state == "RUNNING" else ("stopped" if alive is not False else "dead")
    if alive is False:
        return "done" if exit_info is not None and exit_info.get("status") == "completed" else "dead"
    if recorded is None and alive is None:
        return "unknown"  # a bare run dir: no status and no process to ask
    return "running"


def read_run(run_dir: Path, cluster_states: dict[str, str] | None = None) -> RunInfo:
    """Read one run dir; `cluster_states` (from `slurm_states`) avoids one sacct call per run.

    A run dir whose files cannot be read as a run's (not UTF-8, a list where an object belongs, a step
    that is no number, a directory named status.json) is `unreadable`, with the reason as its error, so
    one damaged dir never hides the others from `retrain status` or a sweep's summary.
    """
    try:
        return _read_run(run_dir, cluster_states)
    except (OSError, ValueError, TypeError) as error:
        return RunInfo(
            dir=run_dir,
            name=run_dir.name,
            condition=None,
            seed=None,
            state=UNREADABLE,
            error=f"{type(error).__name__}: {error}",
        )


def read_job(run_dir: Path) -> dict[str, Any]:
    """The campaign callback's job.json; {} when absent or unreadable (then `read_run` says why)."""
    try:
        return _read_object(RunDir(run_dir).read_job, JOB_FILE)
    except ValueError:
        return {}


def _read_run(run_dir: Path, cluster_states: dict[str, str] | None) -> RunInfo:
    files = RunDir(run_dir)
    status = _read_object(files.read_status, STATUS_FILE)
    job = _read_object(files.read_job, JOB_FILE)
    exit_info = _read_object(files.read_exit, EXIT_FILE) if files.exit_file.exists() else None
    config = _read_object(files.read_hydra_config, ".hydra/config.yaml")
    if job.get("slurm") is not None:
        _mapping(job["slurm"], f"{JOB_FILE}'s slurm")
    job_id = slurm_job_id(job)
    if cluster_states is None and job_id:
        cluster_states = slurm_states([job_id])
    cluster_state = (cluster_states or {}).get(job_id) if job_id else None
    training = _mapping(config.get("training") or {}, ".hydra/config.yaml's training")
    condition = status.get("condition") or _condition_of(config)
    seed = status.get("seed", training.get("seed"))
    max_steps = status.get("max_steps", training.get("max_steps"))
    error = status.get("error") or (exit_info or {}).get("error")
    recorded_state = status.get("state")
    if recorded_state is not None and not isinstance(recorded_state, str):
        raise ValueError(f"{STATUS_FILE} records the state {recorded_state!r}")
    return RunInfo(
        dir=run_dir,
        name=run_dir.name,
        condition=None if condition is None else str(condition),
        seed=None if seed is None else _whole(seed, "the seed"),
        # job.json is rewritten by every attempt (a requeue is a new process); status.json as a fallback
        state=resolve_state(recorded_state, job if job.get("pid") else status, exit_info, cluster_state),
        step=_whole(status.get("step", -1), f"{STATUS_FILE}'s step"),
        max_steps=None if max_steps is None else _whole(max_steps, "max_steps"),
        error=None if error is None else str(error),
        updated_at=None if status.get("updated_at") is None else float(status["updated_at"]),
        job=job,
        exit=exit_info,
        metrics=[record for record in files.metrics_records() if isinstance(record, dict)],
        eval=_mapping(status.get("eval") or {}, f"{STATUS_FILE}'s eval"),
    )


def _whole(value: Any, what: str) -> int:
    """A count a run recorded (its step, seed, max_steps), or ValueError naming it: JSON's `Infinity` or `NaN`,
    a list or a word is none, and one such value makes the run `unreadable`, not `retrain status` fail."""
    try:
        return int(value)
    except (TypeError, ValueError, OverflowError) as error:
        raise ValueError(f"{what} is {value!r}, not a whole number") from error


def _read_object(read: Callable[[], Any], name: str) -> dict[str, Any]:
    """What `read` returns ({} for a missing file), or ValueError naming the file it could not read as an object."""
    try:
        value = read()
    except (OSError, ValueError) as error:  # a directory in its place, bytes that are not UTF-8, ...
        raise ValueError(f"{name} does not read ({type(error).__name__}: {error})") from error
    return _mapping({} if value is None else value, name)


def _mapping(value: Any, what: str) -> dict[str, Any]:
    """`value` when it is a JSON object / YAML mapping, else ValueError naming the file that holds it."""
    if not isinstance(value, dict):
        raise ValueError(f"{what} holds a {type(value).__name__}, not an object")
    return value


def describe_age(updated_at: float | None) -> str:
    if updated_at is None:
        return "never"
    seconds = max(0.0, time.time() - updated_at)
    for unit, size in (("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit} ago"
    return f"{seconds:.0f} s ago"


def _condition_of(config: dict[str, Any]) -> str | None:
    """`algorithm.name` of a run's saved config, where it is still the resolver that derives it."""
    register_resolvers()
    try:
        name = OmegaConf.select(OmegaConf.create(config), "algorithm.name", throw_on_resolution_failure=False)
    except Exception:  # a foreign or damaged config: the run is still listed, without a condition
        return None
    return None if name is None else str(name)
