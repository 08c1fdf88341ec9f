"""A stop signal that reaches one rank stops every rank after the same step, checkpointed once by rank 0."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import QUICK, checked, cli_env, read_metrics, without_timing
from tests.distributed import TORCHRUN


def rank_pid(launcher: int, rank: int) -> int | None:
    """The pid of torchrun's worker of `rank` (read from the workers' environments), None while not started."""
    children = Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split()
    for child in children:
        environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in environ:
            return int(child)
    return None


def signalled_run(tmp_path: Path, run_dir: Path, delay_s: float, save_every: int) -> str:
    """A 2-rank run of the quickstart whose rank 1 alone gets SIGTERM `delay_s` after the first step is logged; the
    launch's output."""
    command = [*TORCHRUN, "--nproc-per-node=2", "-m", "retrain", *QUICK, "training.max_steps=500"]
    output = tmp_path / f"output-{delay_s}.log"
    launcher = subprocess.Popen(
        [*command, f"training.save_every={save_every}", f"hydra.run.dir={run_dir}"],
        env=cli_env(),
        stdout=output.open("w"),
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 120
        metrics = run_dir / "metrics.jsonl"
        while not (metrics.is_file() and metrics.read_text().strip()):
            assert time.monotonic() < deadline and launcher.poll() is None, "the run never logged a step"
            time.sleep(0.05)
        pid = rank_pid(launcher.pid, 1)
        assert pid is not None
        time.sleep(delay_s)
        os.kill(pid, signal.SIGTERM)
        launcher.wait(timeout=120)  # nonzero: the signalled rank exits 143, as one process does
    finally:
        if launcher.poll() is None:
            launcher.kill()
    return output.read_text()


@pytest.mark.slow
def test_a_signal_to_one_rank_stops_all_after_the_same_step(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    output = signalled_run(tmp_path, run_dir, 0.0, save_every=0)
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "stopped"
    (checkpoint,) = (run_dir / "checkpoints").iterdir()
    assert checkpoint.name == f"step_{status['step'] + 1}"  # rank 0 checkpointed the step the ranks agreed on
    # every rank exits on the state rank 0 recorded once its checkpoint was written, not on its own reading before
    assert output.count("Checkpointed after SIGTERM (state stopped); exiting.") == 2


@pytest.mark.slow
def test_a_signal_during_a_collective_stops_every_rank_with_periodic_checkpoints(tmp_path: Path) -> None:
    """With a checkpoint every step, rank 1 spends much of each step in the stop's all-reduce, waiting for rank 0 to
    write: a signal landing there sets its flag after it voted. Signalled at several moments, the ranks still stop
    after the same step, and the run resumes from that checkpoint exactly as if never stopped."""
    for delay_s in (0.0, 0.3, 0.7):
        run_dir = tmp_path / f"run-{delay_s}"
        output = signalled_run(tmp_path, run_dir, delay_s, save_every=1)
        status = json.loads((run_dir / "status.json").read_text())
        assert status["state"] == "stopped", output[-3000:]
        assert output.count("Checkpointed after SIGTERM (state stopped); exiting.") == 2, output[-3000:]
        assert (run_dir / "checkpoints" / f"step_{status['step'] + 1}").is_dir()
    stopped_after = status["step"] + 1
    more = [*QUICK, "training.save_every=1", f"training.max_steps={stopped_after + 2}"]
    checked(run_two_ranks([*more, f"hydra.run.dir={run_dir}"], tmp_path))
    whole = tmp_path / "whole"
    checked(run_two_ranks([*more, f"hydra.run.dir={whole}"], tmp_path))
    assert without_timing(read_metrics(run_dir)) == without_timing(read_metrics(whole))


def run_two_ranks(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    command = [*TORCHRUN, "--nproc-per-node=2", "-m", "retrain", *args]
    return subprocess.run(command, cwd=cwd, env=cli_env(), capture_output=True, text=True, timeout=600)
