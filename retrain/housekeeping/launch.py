"""Claiming a run dir: one process at a time, one run per dir, and not a byte written before both hold.

A second launch into a run dir that another process is training in, or that holds a run with another
config, is refused before it writes anything there: the live run's provenance, job record and log stay
as they were. So Hydra writes nothing before the task runs (`hydra.output_subdir: null`, conf/config.yaml),
and what it would have written (`.hydra/config.yaml`, `hydra.yaml`, `overrides.yaml`), the attempt's
job record and the run's identity are written here, once the lock is held and the identity matches.

    with claimed_run_dir(run_dir, identity):
        record_launch(run_dir, cfg)
        ...train...
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hydra.conf import HydraConf
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from retrain.errors import ConfigError
from retrain.housekeeping.rundir import RunDir, read_json, write_json_atomic
from retrain.housekeeping.secrets import (
    MASK,
    from_environment,
    looks_secret,
    masked_config,
    masked_override,
    masked_values,
)

log = logging.getLogger("retrain")


class RunDirRefused(ConfigError):
    """A launch refused before it wrote into its run dir: another process trains there, or another run lives there."""


@contextmanager
def claimed_run_dir(run_dir: Path, identity: dict[str, Any]) -> Iterator[None]:
    """Hold the run dir's lock and record `identity` as its run's, or raise RunDirRefused having written nothing.

    A dir that already holds training (a metrics record or a checkpoint) of a run with another identity is
    refused; one whose earlier launch never trained a step (it failed at start) is taken over.
    """
    files = RunDir(run_dir)
    with open(files.lock_file, "a") as lock:  # "a": never truncates (or touches) the live run's lock file
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunDirRefused(
                f"run dir {run_dir} is in use by another retrain process; in a sweep that "
                "varies more than algorithm and training.seed, add the varied keys to "
                "hydra.sweep.subdir (see docs/configuration.md)"
            ) from None
        recorded = recorded_identity(files)
        if recorded is not None:
            check_same_run(recorded, identity, run_dir)
        write_json_atomic(files.identity_file, identity)
        yield


def held_elsewhere(run_dir: Path) -> bool:
    """Whether another process holds the run dir's lock now (a live run that this process must not write into)."""
    lock_file = RunDir(run_dir).lock_file
    if not lock_file.is_file():
        return False
    with open(lock_file, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(lock, fcntl.LOCK_UN)
    return False


def recorded_identity(files: RunDir) -> dict[str, Any] | None:
    """The identity of the run this dir holds; None while it holds no training (no metrics, no checkpoint).

    A run dir written before run_identity.json existed has its run's identity in its checkpoints' state.
    """
    metrics = files.metrics
    if not (metrics.is_file() and metrics.stat().st_size > 0) and not files.checkpoints():
        return None
    recorded = read_json(files.identity_file)
    if recorded is None and (latest := files.latest_checkpoint()) is not None:
        try:
            recorded = latest.state().get("config_identity")
        except (OSError, ValueError, AttributeError):  # a damaged state: the restart sets it aside and says so
            recorded = None
    return recorded or None


def check_same_run(saved: dict[str, Any], current: dict[str, Any], run_dir: Path) -> None:
    """Entering a run dir again continues that run only if it is the same run (else a clear error).

    A value kept private (a secret-looking key, an environment variable) counts by its presence only:
    rotating a key never blocks a resume, and a value saved by an older version is never shown.
    """

    def private(key: str) -> bool:
        return looks_secret(key) or from_environment(current.get(key))

    def differs(key: str) -> bool:
        if private(key):
            return (key in saved) != (key in current)
        return saved.get(key) != current.get(key)

    differing = sorted(k for k in saved.keys() | current.keys() if differs(k))
    if differing:
        shown = ", ".join(
            f"{k}: {MASK if private(k) and k in saved else repr(saved.get(k))} -> {current.get(k)!r}"
            for k in differing[:5]
        )
        raise RunDirRefused(
            f"run dir {run_dir} holds a run with a different config ({shown}); use a new "
            "hydra.run.dir (in a sweep: hydra.sweep.dir), or resume.from=<that dir> in a new one to continue "
            "it with the new settings"
        )


def record_launch(run_dir: Path, cfg: DictConfig) -> None:
    """Write what Hydra would have written at the start of the job, and this attempt's job record (job.json).

    Secret-looking values typed on the command line are masked in both; nothing is written outside a Hydra job.
    """
    if not HydraConfig.initialized():
        return
    files = RunDir(run_dir)
    # unresolved, as typed: `+reward.auth=${oc.env:MY_TOKEN}` stays that (reading the node would resolve it);
    # every string masked: the overrides, override_dirname, a url's credentials anywhere
    hydra_node: dict[str, Any] = masked_values(OmegaConf.to_container(HydraConfig.instance().cfg, resolve=False))
    overrides = [masked_override(str(o)) for o in hydra_node["hydra"]["overrides"]["task"]]
    hydra_node["hydra"]["overrides"]["task"] = overrides
    files.hydra_dir.mkdir(exist_ok=True)
    _write_text(files.hydra_config, OmegaConf.to_yaml(masked_config(cfg)))
    _write_text(files.hydra_dir / "hydra.yaml", OmegaConf.to_yaml(OmegaConf.create(hydra_node)))
    _write_text(files.hydra_dir / "overrides.yaml", OmegaConf.to_yaml(OmegaConf.create(overrides)))
    record_job_start(files, HydraConfig.get(), overrides)


def slurm_ids() -> dict[str, Any]:
    names = {
        "job_id": "SLURM_JOB_ID",
        "array_job_id": "SLURM_ARRAY_JOB_ID",
        "array_task_id": "SLURM_ARRAY_TASK_ID",
        "restart_count": "SLURM_RESTART_COUNT",
    }
    return {key: os.environ[var] for key, var in names.items() if var in os.environ}


def record_job_start(run_dir: RunDir, hydra: HydraConf, overrides: list[str]) -> None:
    """job.json of this attempt, and no exit.json of an earlier one: written once the job holds the run dir."""
    run_dir.exit_file.unlink(missing_ok=True)  # an earlier attempt's ending is not this one's
    write_json_atomic(
        run_dir.job_file,
        {
            "num": int(hydra.job.num) if hydra.mode == RunMode.MULTIRUN else None,
            "overrides": overrides,
            "pid": os.getpid(),
            "hostname": socket.gethostname(),
            "started_at": time.time(),
            "slurm": slurm_ids(),
        },
    )


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
