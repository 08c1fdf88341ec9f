"""Hydra callback that turns a `--multirun` into a campaign with a manifest and a summary.

    hydra:
      callbacks:
        campaign:
          _target_: retrain.campaign.callbacks.CampaignCallback
          baseline: grpo_none      # optional: last_k, entropy_pair, confidence

Where each hook runs matters: on_multirun_* run in the driver (the `python -m retrain --multirun`
process); on_job_* run inside each job — on SLURM that is another process, possibly another node.
So every job leaves its own files (job.json once it holds its run dir, written by
retrain/housekeeping/launch.py; exit.json at the end; neither when the dir is another run's) and refreshes the
sweep's manifest and summary itself, under a lock: the summary is current even if the driver is
killed, or if Hydra stops before `on_multirun_end` (it does when a job fails).
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig
from omegaconf.errors import InterpolationResolutionError

from retrain.campaign.manifest import CampaignSettings, start_manifest, sweep_lock
from retrain.campaign.plan import (
    check_first_job_composes,
    check_run_dirs_apart,
    name_swept_keys_in_subdir,
    planned_jobs,
)
from retrain.campaign.report import refresh
from retrain.config import container_dict
from retrain.config_checks.compose_errors import output_dir_unwritable, unresolvable
from retrain.distributed.rendezvous import env_int
from retrain.errors import ConfigError, UserError
from retrain.housekeeping.launch import RunDirRefused, held_elsewhere, slurm_ids
from retrain.housekeeping.rundir import RunDir, write_json_atomic
from retrain.housekeeping.secrets import mask_text

log = logging.getLogger("retrain.campaign")


def sweep_dir_of(config: DictConfig) -> Path:
    """The sweep dir as the driver resolved it (jobs may run in another working directory)."""
    output_dir = Path(str(config.hydra.runtime.output_dir))
    depth = len(Path(str(config.hydra.sweep.subdir)).parts)
    return output_dir.parents[depth - 1]


def _resolved_sweep_dir(config: DictConfig) -> Path:
    """The sweep dir; a ConfigError naming it when its interpolation cannot resolve (`${oc.env:UNSET}`)."""
    try:
        return Path(str(config.hydra.sweep.dir)).resolve()
    except InterpolationResolutionError as error:
        raise ConfigError(unresolvable(error)) from error


def _make(sweep_dir: Path) -> None:
    """Create the sweep dir now, so that a file in its way or a missing permission is one line, not
    the launcher's traceback after this callback's warning."""
    try:
        sweep_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ConfigError(output_dir_unwritable("hydra.sweep.dir", error)) from error


def _multirun(config: DictConfig) -> bool:
    return config.hydra.mode == RunMode.MULTIRUN


class CampaignCallback(Callback):
    """Manifest at the start, per-job files, live summary; LoRA-Squeeze of the first finished run."""

    def __init__(
        self,
        baseline: str = "grpo_none",
        last_k: int = 10,
        entropy_pair: list[str] | None = None,
        confidence: float = 0.95,
    ) -> None:
        pair = list(entropy_pair) if entropy_pair is not None else CampaignSettings().entropy_pair
        self.settings = CampaignSettings(baseline=baseline, last_k=last_k, entropy_pair=pair, confidence=confidence)
        self._sweep_dir: Path | None = None
        self._ended = False

    # ---- driver --------------------------------------------------------------------------
    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from retrain.campaign.autosqueeze import squeeze_settings  # imports torch: only in a sweep

        try:
            self._sweep_dir = _resolved_sweep_dir(config)
            squeeze = squeeze_settings(config)
            plan = planned_jobs(config)
            check_first_job_composes(config, plan or [])
            subdir = name_swept_keys_in_subdir(config, plan or [])
            check_run_dirs_apart(config, plan or [])
            _make(self._sweep_dir)
        except UserError as error:  # Hydra warns of a callback's exception, then launches every job anyway
            print(f"retrain: {error}", file=sys.stderr)
            raise SystemExit(1) from None  # so the sweep stops here, before its first job
        launcher = str(config.hydra.launcher.get("_target_", "")).rsplit(".", 1)[-1]
        start_manifest(
            self._sweep_dir,
            plan,
            self.settings,
            launcher,
            None if squeeze is None else container_dict(config.squeeze, "squeeze"),
        )
        log.info(
            "Campaign: %s jobs, manifest at %s", "?" if plan is None else len(plan), self._sweep_dir / "manifest.json"
        )
        if subdir is not None:
            log.info("Run dirs name every swept key: hydra.sweep.subdir=%s", subdir)
        # Hydra skips on_multirun_end when a job fails or the driver is interrupted: refresh anyway.
        atexit.register(self._refresh_at_exit)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        campaign = refresh(Path(str(config.hydra.sweep.dir)).resolve(), driver_exiting=True)
        self._ended = True
        log.info(
            "Campaign %s: %s. Summary: %s", campaign.sweep_dir.name, campaign.state, campaign.sweep_dir / "summary.md"
        )

    def _refresh_at_exit(self) -> None:
        if self._ended or self._sweep_dir is None:
            return
        try:
            refresh(self._sweep_dir, driver_exiting=True)
        except Exception as error:  # the driver is exiting anyway: report, do not mask its own error
            log.warning("Could not refresh the campaign summary at exit: %s", error)

    # ---- each job (possibly on a cluster node) -------------------------------------------
    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        # nothing is written into the run dir yet: the job may find it in use (retrain/housekeeping/launch.py)
        if _multirun(config):
            refresh(sweep_dir_of(config), with_summary=False)

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        if env_int("RANK", 0) != 0:
            return  # another rank of a data-parallel run (torchrun, submitit tasks): rank 0 records the run's end
        run_dir = RunDir(Path(str(config.hydra.runtime.output_dir)))
        failed = job_return.status == JobStatus.FAILED
        value = getattr(job_return, "_return_value", None)  # .return_value re-raises a job's exception
        value = getattr(value, "user_error", None) or value  # a user's mistake comes wrapped (retrain/cli.py)
        if isinstance(value, RunDirRefused) or held_elsewhere(run_dir.path):
            return  # the dir is another run's: its files, the sweep's record of it included, stay as they are
        write_json_atomic(
            run_dir.exit_file,
            {
                "status": "failed" if failed else "completed",
                "error": mask_text(f"{type(value).__name__}: {value}") if failed else None,
                "finished_at": time.time(),
                "pid": os.getpid(),
                "hostname": socket.gethostname(),
                "slurm": slurm_ids(),
            },
        )
        if not _multirun(config):
            return
        from retrain.campaign.autosqueeze import squeeze_first_finished, squeeze_settings  # imports torch

        sweep_dir = sweep_dir_of(config)
        settings = squeeze_settings(config)
        if settings is not None and not failed and run_dir.read_status().get("state") == "done":
            with sweep_lock(sweep_dir):
                try:
                    squeeze_first_finished(sweep_dir, run_dir, settings, config)
                except Exception as error:  # the run itself succeeded; the analysis is a report
                    log.warning("Auto-squeeze of %s failed: %s", run_dir.path, error)
        refresh(sweep_dir)
