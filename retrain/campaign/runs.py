"""What one run dir says about its run, read only from files (the run may live in another process,
on another node, or be dead): status.json and metrics.jsonl (the trainer's), job.json and exit.json
(the campaign callback's), .hydra/ (Hydra's).

A run's state is one of:
  pending  planned, not started             running  alive and training
  stopped  pre-empted, checkpointed, waiting for its requeue
  done     finished all steps                failed   raised an error (see `error`)
  dead     says running/stopped, but its process or cluster job is gone
  unknown  a bare run dir (no status.json, no job.json): nothing to ask
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from retrain.config import register_resolvers
from retrain.rundir import RunDir

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

    @property
    def has_adapter(self) -> bool:
        return self.dir is not None and RunDir(self.dir).final_adapter.is_file()

    def brief(self) -> dict[str, Any]:
        """The manifest's view of the run (no per-step records)."""
        return {
            "name": self.name,
            "dir": None if self.dir is None else str(self.dir),
            "condition": self.condition,
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
        return "running" if alive and cluster_state == "RUNNING" else ("stopped" if alive is not False else "dead")
    if alive is False:
        return "done" if exit_info is not None and exit_info.get("status") == "completed" else "dead"
    if recorded is None and alive is None:
        return "unknown"  # a bare run dir: no status and no process to ask
    return "running"


def read_run(run_dir: Path, cluster_states: dict[str, str] | None = None) -> RunInfo:
    """Read one run dir; `cluster_states` (from `slurm_states`) avoids one sacct call per run."""
    files = RunDir(run_dir)
    status = files.read_status()
    job = files.read_job()
    exit_info = files.read_exit()
    config = files.read_hydra_config()
    job_id = slurm_job_id(job)
    if cluster_states is None and job_id:
        cluster_states = slurm_states([job_id])
    cluster_state = (cluster_states or {}).get(job_id) if job_id else None
    condition = status.get("condition") or _condition_of(config)
    seed = status.get("seed", (config.get("training") or {}).get("seed"))
    max_steps = status.get("max_steps", (config.get("training") or {}).get("max_steps"))
    error = status.get("error") or (exit_info or {}).get("error")
    return RunInfo(
        dir=run_dir,
        name=run_dir.name,
        condition=condition,
        seed=None if seed is None else int(seed),
        # job.json is rewritten by every attempt (a requeue is a new process); status.json as a fallback
        state=resolve_state(status.get("state"), job if job.get("pid") else status, exit_info, cluster_state),
        step=int(status.get("step", -1)),
        max_steps=max_steps,
        error=error,
        updated_at=status.get("updated_at"),
        job=job,
        exit=exit_info,
        metrics=files.metrics_records(),
    )


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
