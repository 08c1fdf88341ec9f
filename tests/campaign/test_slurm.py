"""Campaigns on the real one-node SLURM cluster of launchers/slurm/cluster.sh.

bash launchers/slurm/cluster.sh install && bash launchers/slurm/cluster.sh start
python -m pytest -m slurm tests/campaign/test_slurm.py
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from retrain.campaign.runs import slurm_job_id
from tests.conftest import QUICK, REPO, read_metrics, run_cli, without_timing

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

# CPU-only node: no GPUs, one core and a little memory per job, one thread per process
SLURM = [
    "hydra/launcher=slurm",
    "hydra.launcher.gpus_per_node=null",
    "hydra.launcher.cpus_per_task=1",
    "hydra.launcher.mem_gb=3",
    "hydra.launcher.array_parallelism=2",
    "hydra.launcher.setup=['export OMP_NUM_THREADS=1']",
]


def _cluster_problem() -> str | None:
    if shutil.which("sinfo") is None or shutil.which("sacct") is None:
        return (
            "SLURM is not installed: bash launchers/slurm/cluster.sh install && bash launchers/slurm/cluster.sh start"
        )
    try:
        nodes = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, timeout=15)
        accounting = subprocess.run(["sacct", "-n", "-X", "-S", "now"], capture_output=True, text=True, timeout=15)
    except subprocess.TimeoutExpired:
        return "the SLURM controller does not answer: bash launchers/slurm/cluster.sh start"
    if nodes.returncode != 0:
        return f"sinfo fails ({nodes.stderr.strip()[:200]}): bash launchers/slurm/cluster.sh start"
    if not any(state.startswith(("idle", "mix", "alloc")) for state in nodes.stdout.split()):
        return f"no usable SLURM node (states: {nodes.stdout.split()})"
    if accounting.returncode != 0:
        return f"SLURM accounting (slurmdbd) does not answer: {accounting.stderr.strip()[:200]}"
    return None


@pytest.fixture(scope="module")
def slurm_cluster() -> Iterator[None]:
    """The cluster, held by this module alone: the two test workers may each take a SLURM module, and the node's two
    CPUs run one module's jobs at a time (a job queued behind the other module's would miss the times it is held to)."""
    problem = _cluster_problem()
    if problem:
        pytest.skip(problem)
    with open(Path(tempfile.gettempdir()) / "retrain-tests-slurm-cluster.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}


def test_campaign_of_two_conditions_by_two_seeds_on_slurm(slurm_cluster: None, tmp_path: Path) -> None:
    sweep_dir = tmp_path / "sweep"
    started = time.monotonic()
    run_cli(
        [
            "--multirun",
            "+campaign=ablation",
            *QUICK,
            *SLURM,
            "training.max_steps=3",
            "training.save_every=0",
            "algorithm=grpo_none,maxrl_gtpo_sepa",
            "training.seed=1,2",
            "hydra.launcher.timeout_min=15",
            f"hydra.sweep.dir={sweep_dir}",
        ],
        cwd=tmp_path,
        timeout=900,
    )
    print(f"2x2 SLURM campaign took {time.monotonic() - started:.0f} s")
    names = [f"{c}_s{s}" for c in ("grpo_none", "maxrl_gtpo_sepa") for s in (1, 2)]
    for name in names:
        run_dir = sweep_dir / name
        assert [r["step"] for r in read_metrics(run_dir)] == [0, 1, 2], name
        assert (run_dir / "final" / "adapter_model.safetensors").is_file(), name
        job = json.loads((run_dir / "job.json").read_text())
        assert job["slurm"].get("array_job_id"), f"{name} did not run as a SLURM array task: {job}"
    manifest = json.loads((sweep_dir / "manifest.json").read_text())
    assert manifest["launcher"] == "SlurmLauncher" and manifest["state"] == "done"
    assert sorted(r["name"] for r in manifest["runs"]) == sorted(names)
    assert all(r["state"] == "done" for r in manifest["runs"])
    summary = (sweep_dir / "summary.md").read_text()
    for name in names:
        assert f"`{name}`" in summary
    assert json.loads((sweep_dir / "summary.json").read_text())["state"] == "done"


def _wait_for(predicate, timeout: float, what: str, poll: float = 1.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


CREDENTIAL_REVOKE_WAIT_S = 2.0  # past the second in which the old attempt's credential was revoked


def _release_requeued(job_id: str, updates: tuple[str, ...] = ()) -> bool:
    """SLURM holds a requeued job for a fixed 120 s; let it start now (the test is about what happens next), with
    `updates` to the job's record (scontrol's Field=value) too.

    Not within the second of the requeue: slurmd revokes the old attempt's credential at second
    resolution, so a relaunch in that same second is killed ("Job credential revoked", seen once in CI).
    """
    state = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True).stdout.strip()
    if state == "PENDING":
        time.sleep(CREDENTIAL_REVOKE_WAIT_S)
        subprocess.run(["scontrol", "update", f"jobid={job_id}", "StartTime=now", *updates], capture_output=True)
        return True
    return False


def _job_history(job_id: str, run_dir: Path) -> str:
    """What a stuck job went through: each attempt as accounting saw it, and the run log's end."""
    attempts = subprocess.run(
        ["sacct", "-j", job_id, "--duplicates", "-X", "-o", "JobID,State,Start,End,Elapsed,Timelimit,Reason%30"],
        capture_output=True,
        text=True,
    ).stdout
    log = run_dir / "run.log"
    tail = log.read_text()[-2000:] if log.is_file() else "(no run.log)"
    return f"sacct:\n{attempts}\nsteps logged: {_steps_logged(run_dir)}\nrun.log's end:\n{tail}"


def _steps_logged(run_dir: Path) -> int:
    return len(read_metrics(run_dir)) if (run_dir / "metrics.jsonl").is_file() else 0


# Step counts leave the signal time to land: the signals go out once three steps are logged (polled each
# second), or, for the time limit, 30-90 s into the job. A quickstart step takes 40-250 ms (one thread per job;
# the machine's speed and load decide), so the time limit's run is sized by a measured step instead: about
# TIME_LIMIT_WORK_S of steps, more than one 2-minute job can do. Its requeued attempt is released with a limit
# that lets it finish: one time limit is the event under test, and how many more a run needs is the machine's
# speed under load, which once took it past the test's timeout (three 2-minute attempts and more, on a slow CI
# machine beside another worker's test).
INTERRUPTIONS = {
    # what a pre-empting scheduler sends (and submitit's own tests): SIGTERM, then the warning signal
    "preempted": {"steps": 120, "launcher": ["hydra.launcher.timeout_min=15"]},
    # an admin's requeue: SIGTERM, then SIGKILL after KillWait; the run checkpoints after its step in
    # flight (or, had that not fitted in KillWait, would resume from its last periodic checkpoint)
    "requeued": {"steps": 120, "launcher": ["hydra.launcher.timeout_min=15"], "save_every": 5},
    # a real time limit: SLURM warns 60 s before the 2-minute limit (its timer is coarse: ±30 s)
    "time_limit": {
        "steps": 0,
        "launcher": ["hydra.launcher.timeout_min=2", "hydra.launcher.signal_delay_s=60"],
        "release": ("TimeLimit=15",),
    },
}
TIME_LIMIT_WORK_S = 150  # a job steps for at most ~80 s before the warning (90 s, less its start)
CALIBRATION_STEPS = 30


def _steps_taking(seconds: float, tmp_path: Path) -> int:
    """How many quickstart steps take about `seconds` here now: the median of a short run's later steps."""
    run_dir = tmp_path / "calibration"
    run_cli(
        [
            *QUICK,
            f"training.max_steps={CALIBRATION_STEPS}",
            "training.save_every=0",
            "algorithm=maxrl_gtpo_sepa",
            f"hydra.run.dir={run_dir}",
        ],
        cwd=tmp_path,
    )
    step_s = statistics.median(r["step_time_s"] for r in read_metrics(run_dir)[CALIBRATION_STEPS // 3 :])
    return max(300, math.ceil(seconds / step_s))


def _interrupt(kind: str, job_id: str, run_dir: Path) -> None:
    if kind == "time_limit":
        return  # SLURM does it
    _wait_for(lambda: _steps_logged(run_dir) >= 3, 300, "three steps")
    if kind == "preempted":
        subprocess.run(["scancel", "--signal=TERM", job_id], check=True)
        subprocess.run(["scancel", "--signal=USR2", job_id], check=True)
    else:
        subprocess.run(["scontrol", "requeue", job_id], check=True)


def run_interrupted(
    reference_command: list[str],
    sweep_args: list[str],
    run_dir: Path,
    kind: str,
    wait_s: float,
    release: tuple[str, ...] = (),
) -> tuple[str, subprocess.Popen[str], str, subprocess.Popen[str], str]:
    """A sweep of one SLURM job (`python -m retrain` with `sweep_args`), interrupted as `kind` once it holds
    `run_dir` and let run to its end within `wait_s` (requeued attempts released at once, with `release`'s updates),
    beside an uninterrupted reference started the same moment: (job id, the driver, its output, the reference, its
    stderr). A sweep still running at `wait_s` fails the test with the job's history."""
    cwd = run_dir.parent.parent
    deadline = time.monotonic() + wait_s
    reference = subprocess.Popen(
        reference_command, cwd=cwd, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    driver = subprocess.Popen(
        [sys.executable, "-m", "retrain", *sweep_args],
        cwd=cwd,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        job = _wait_for(
            lambda: json.loads((run_dir / "job.json").read_text()) if (run_dir / "job.json").is_file() else None,
            300,
            "the job to start",
        )
        job_id = slurm_job_id(job)  # a sweep of one run is a plain job, not an array
        _interrupt(kind, job_id, run_dir)  # every task of the job gets the signals
        while driver.poll() is None and time.monotonic() < deadline:
            _release_requeued(job_id, release)
            time.sleep(2)
        if driver.poll() is None:
            history = _job_history(job_id, run_dir)
            driver.kill()
            output = driver.communicate(timeout=60)[0]
            raise AssertionError(f"the sweep did not end within {wait_s:.0f} s\n{history}\ndriver:\n{output[-2000:]}")
        output = driver.communicate(timeout=60)[0]
        reference_error = reference.communicate(timeout=max(60.0, deadline - time.monotonic()))[1]
    finally:
        for process in (driver, reference):
            if process.poll() is None:
                process.kill()
    return job_id, driver, output, reference, reference_error


@pytest.mark.timeout(900)  # calibration, then the sweep's wait_s, then the diagnosis
@pytest.mark.parametrize("kind", list(INTERRUPTIONS))
def test_interrupted_job_is_requeued_and_resumes_the_same_trajectory(
    slurm_cluster: None, tmp_path: Path, kind: str
) -> None:
    spec = INTERRUPTIONS[kind]
    steps = spec["steps"] or _steps_taking(TIME_LIMIT_WORK_S, tmp_path)
    save_every = spec.get("save_every", 0)
    common = [
        *QUICK,
        f"training.max_steps={steps}",
        f"training.save_every={save_every}",
        "training.seed=5",
        "algorithm=maxrl_gtpo_sepa",
    ]
    # the uninterrupted reference trains at the same time, on the other core
    reference_dir = tmp_path / "reference"
    sweep_dir = tmp_path / "sweep"
    run_dir = sweep_dir / "maxrl_gtpo_sepa_s5"
    _, driver, output, reference, reference_error = run_interrupted(
        [sys.executable, "-m", "retrain", *common, f"hydra.run.dir={reference_dir}"],
        [
            "--multirun",
            "+campaign=ablation",
            *common,
            *SLURM,
            *spec["launcher"],
            "hydra.launcher.max_num_timeout=10",
            f"hydra.sweep.dir={sweep_dir}",
        ],
        run_dir,
        kind,
        wait_s=720,
        release=spec.get("release", ()),
    )
    assert reference.returncode == 0, reference_error[-4000:]
    assert driver.returncode == 0, output[-4000:]

    job = json.loads((run_dir / "job.json").read_text())
    assert int(job["slurm"].get("restart_count", 0)) >= 1, f"the job was never requeued: {job}"
    log = (run_dir / "run.log").read_text()
    assert "Resumed from" in log
    checkpoints = sorted(int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*"))
    if kind == "requeued":
        assert "Received SIGTERM: stopping after this step to checkpoint." in log
        assert set(range(save_every, steps + 1, save_every)) <= set(checkpoints)
    else:  # save_every=0: the only checkpoints are the ones written on the signal
        assert "Received SIGUSR2: stopping after this step to checkpoint and requeue." in log
        assert checkpoints and all(0 < step < steps for step in checkpoints)
    assert json.loads((run_dir / "status.json").read_text())["state"] == "done"
    assert without_timing(read_metrics(run_dir)) == without_timing(read_metrics(reference_dir))


def test_a_cancelled_job_ends_the_sweep_and_is_reported_dead(slurm_cluster: None, tmp_path: Path) -> None:
    """Accounting at work: submitit sees the cancellation (no endless wait) and status says dead."""
    sweep_dir = tmp_path / "sweep"
    driver = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "retrain",
            "--multirun",
            "+campaign=ablation",
            *QUICK,
            *SLURM,
            "training.max_steps=2000",
            "training.save_every=0",
            "algorithm=grpo_none",
            "training.seed=3",
            "hydra.launcher.timeout_min=15",
            f"hydra.sweep.dir={sweep_dir}",
        ],
        cwd=tmp_path,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    run_dir = sweep_dir / "grpo_none_s3"
    try:
        _wait_for(lambda: _steps_logged(run_dir) >= 2, 300, "two steps")
        job_id = slurm_job_id(json.loads((run_dir / "job.json").read_text()))
        subprocess.run(["scancel", job_id], check=True)
        output = driver.communicate(timeout=180)[0]
    finally:
        if driver.poll() is None:
            driver.kill()
    assert driver.returncode != 0, output[-3000:]
    status = json.loads(run_cli(["status", str(sweep_dir), "--json"], cwd=tmp_path).stdout)
    assert status["state"] == "dead"
    assert [(r["name"], r["state"]) for r in status["runs"]] == [("grpo_none_s3", "dead")]
    assert "`grpo_none_s3` (dead)" in (sweep_dir / "summary.md").read_text()
