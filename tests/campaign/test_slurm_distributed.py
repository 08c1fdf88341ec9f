"""One data-parallel run as a SLURM job of two tasks (`hydra/launcher=slurm hydra.launcher.tasks_per_node=2`) on the
real one-node cluster of launchers/slurm/cluster.sh: two ranks, one run dir, the first step as one process's; pre-empted,
the job checkpoints once, is requeued whole and both ranks resume the same trajectory.

bash launchers/slurm/cluster.sh install && bash launchers/slurm/cluster.sh start
python -m pytest -m slurm tests/campaign/test_slurm_distributed.py
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.campaign.test_slurm import (  # noqa: F401  (slurm_cluster: a fixture)
    SLURM,
    run_interrupted,
    slurm_cluster,
)
from tests.conftest import QUICK, read_metrics, run_cli, without_timing
from tests.distributed import TORCHRUN
from tests.distributed.test_same_as_one_rank import STEPS, assert_first_step_as_one, one_rank  # noqa: F401

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

# the node's two CPUs: one task (rank) on each, one thread per rank; memory for the job's two processes
TWO_TASKS = [
    *(o for o in SLURM if not o.startswith(("hydra.launcher.mem_gb=", "hydra.launcher.setup="))),
    "hydra.launcher.tasks_per_node=2",
    "hydra.launcher.mem_gb=6",
]


def setup(*lines: str) -> str:
    """The job script's setup lines: one thread per rank, then `lines`."""
    return f"hydra.launcher.setup={['export OMP_NUM_THREADS=1', *lines]}"


def test_a_slurm_job_of_two_tasks_is_one_run_on_two_ranks(
    slurm_cluster: None,  # noqa: F811
    one_rank: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    sweep = tmp_path / "sweep"
    started = time.monotonic()
    run_cli(
        ["--multirun", *TWO_TASKS, setup(), "hydra.launcher.timeout_min=15", f"hydra.sweep.dir={sweep}", *STEPS],
        cwd=tmp_path,
    )
    print(f"2-task SLURM job took {time.monotonic() - started:.0f} s")
    (two,) = (path for path in sweep.iterdir() if (path / "metrics.jsonl").is_file())  # one run dir
    assert_first_step_as_one(two, one_rank)
    assert all(record["dist/world_size"] == 2 for record in read_metrics(two))
    job = json.loads((two / "job.json").read_text())
    assert job["slurm"].get("job_id"), f"the run did not run as a SLURM job: {job}"
    assert "data-parallel: rank 0 of 2" in (two / "run.log").read_text()  # rank 0 wrote the run dir
    ended = json.loads((two / "exit.json").read_text())
    assert ended["status"] == "completed" and ended["pid"] == job["pid"]  # rank 0 recorded the job's start and end


INTERRUPTED_STEPS = 60  # a 2-rank quickstart step takes 0.2-0.5 s here: the signals land well before the end
# srun as SLURM configures it by default, and as clusters with KillOnBadExit=1 run it: there a task that exits
# with an error ends the job's other tasks at once, so no rank may exit before rank 0 has checkpointed and requeued
SRUN = {"default": [], "kill_on_bad_exit": ["export SLURM_KILL_BAD_EXIT=1"]}


def _interrupted_run(tmp_path: Path, kind: str, srun: list[str], save_every: int) -> tuple[Path, str, Path]:
    """A 2-task job of INTERRUPTED_STEPS, interrupted as test_slurm's `kind` after three steps and let run to its
    end, beside the same run on two ranks under torchrun, uninterrupted: (run dir, job id, reference run dir)."""
    common = [
        *QUICK,
        f"training.max_steps={INTERRUPTED_STEPS}",
        f"training.save_every={save_every}",
        "training.seed=5",
        "algorithm=maxrl_gtpo_sepa",
    ]
    reference_dir = tmp_path / "reference"  # trained at the same time
    sweep_dir = tmp_path / "sweep"
    run_dir = sweep_dir / "maxrl_gtpo_sepa_s5"
    started = time.monotonic()
    job_id, driver, output, reference, reference_error = run_interrupted(
        [*TORCHRUN, "--nproc-per-node=2", "-m", "retrain", *common, f"hydra.run.dir={reference_dir}"],
        [
            "--multirun",
            *common,
            *TWO_TASKS,
            setup(*srun),
            "hydra.launcher.timeout_min=15",
            "hydra.launcher.max_num_timeout=10",
            f"hydra.sweep.dir={sweep_dir}",
        ],
        run_dir,
        kind,
        wait_s=500,
    )
    print(f"{kind} 2-task SLURM job took {time.monotonic() - started:.0f} s")
    assert reference.returncode == 0, reference_error[-4000:]
    assert driver.returncode == 0, output[-4000:]
    submitted = (sweep_dir / ".submitit" / job_id / f"{job_id}_submission.sh").read_text()
    assert all(line in submitted for line in srun)  # srun ran as configured

    job = json.loads((run_dir / "job.json").read_text())
    assert int(job["slurm"].get("restart_count", 0)) >= 1, f"the job was never requeued: {job}"
    log = (run_dir / "run.log").read_text()
    assert "Resumed from" in log
    assert log.count("data-parallel: rank 0 of 2") >= 2  # both attempts ran on two ranks
    assert json.loads((run_dir / "status.json").read_text())["state"] == "done"
    metrics = read_metrics(run_dir)
    assert all(record["dist/world_size"] == 2 for record in metrics)
    assert without_timing(metrics) == without_timing(read_metrics(reference_dir))
    return run_dir, job_id, reference_dir


@pytest.mark.parametrize("srun", list(SRUN))
def test_a_preempted_two_task_job_is_requeued_whole_and_both_ranks_resume(
    slurm_cluster: None,  # noqa: F811
    tmp_path: Path,
    srun: str,
) -> None:
    """SIGTERM, then submitit's SIGUSR2: rank 0 checkpoints once and requeues the job through submitit."""
    run_dir, job_id, _ = _interrupted_run(tmp_path, "preempted", SRUN[srun], save_every=0)
    assert "Received SIGUSR2: stopping after this step to checkpoint and requeue." in (run_dir / "run.log").read_text()
    # rank 1 hands over once rank 0 has checkpointed (it acts on rank 0's recorded state, not its own reading)
    rank1 = (run_dir.parent / ".submitit" / job_id / f"{job_id}_1_log.out").read_text()
    assert "Checkpointed (state stopped); handing over to submitit to requeue this job." in rank1
    assert "state running" not in rank1
    # save_every=0: the one checkpoint is the one rank 0 wrote on the signal, for both ranks
    (checkpoint,) = (run_dir / "checkpoints").glob("step_*")
    assert 0 < int(checkpoint.name.split("_")[1]) < INTERRUPTED_STEPS


def test_an_admins_requeue_of_a_two_task_job_resumes_both_ranks(
    slurm_cluster: None,  # noqa: F811
    tmp_path: Path,
) -> None:
    """`scontrol requeue`: SIGTERM to every task (SIGKILL after KillWait); the ranks stop after the same step, rank 0
    checkpoints, and SLURM itself requeues the job."""
    save_every = 5
    run_dir, job_id, _ = _interrupted_run(tmp_path, "requeued", [], save_every=save_every)
    assert "Received SIGTERM: stopping after this step to checkpoint." in (run_dir / "run.log").read_text()
    rank1 = (run_dir.parent / ".submitit" / job_id / f"{job_id}_1_log.out").read_text()
    assert "Checkpointed after SIGTERM (state stopped); exiting" in rank1 and "state running" not in rank1
    checkpoints = {int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*")}
    assert set(range(save_every, INTERRUPTED_STEPS + 1, save_every)) <= checkpoints
