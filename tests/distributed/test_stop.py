"""A stop signal that reaches one rank stops every rank after the same step, checkpointed once by rank 0."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import QUICK, cli_env
from tests.distributed import TORCHRUN


def rank_pid(launcher: int, rank: int) -> int | None:
    """The pid of torchrun's worker of `rank` (read from the workers' environments), None while not started."""
    children = Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split()
    for child in children:
        environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in environ:
            return int(child)
    return None


@pytest.mark.slow
def test_a_signal_to_one_rank_stops_all_after_the_same_step(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    command = [*TORCHRUN, "--nproc-per-node=2", "-m", "retrain", *QUICK, "training.max_steps=500"]
    output = tmp_path / "output.log"
    launcher = subprocess.Popen(
        [*command, "training.save_every=0", f"hydra.run.dir={run_dir}"],
        env=cli_env(),
        stdout=output.open("w"),
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 120
        metrics = run_dir / "metrics.jsonl"
        while not (metrics.is_file() and metrics.read_text().strip()):
            assert time.monotonic() < deadline and launcher.poll() is None, "the run never logged a step"
            time.sleep(0.2)
        pid = rank_pid(launcher.pid, 1)
        assert pid is not None
        os.kill(pid, signal.SIGTERM)
        launcher.wait(timeout=120)  # nonzero: the signalled rank exits 143, as one process does
    finally:
        if launcher.poll() is None:
            launcher.kill()
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "stopped"
    (checkpoint,) = (run_dir / "checkpoints").iterdir()
    assert checkpoint.name == f"step_{status['step'] + 1}"  # rank 0 checkpointed the step the ranks agreed on
    # every rank exits on the state rank 0 recorded once its checkpoint was written, not on its own reading before
    assert output.read_text().count("Checkpointed after SIGTERM (state stopped); exiting.") == 2
