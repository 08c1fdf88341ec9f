"""A rank that fails ends the whole data-parallel run promptly, and the run's status names that rank and its error."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest

from retrain.distributed.failures import NOTES, RankFailed, rank_failures_recorded
from retrain.distributed.world import World
from retrain.housekeeping.rundir import RunDir
from tests.conftest import QUICK, cli_env
from tests.distributed import TORCHRUN

PLUGINS = "tests.plugins.training_plugins"


@pytest.mark.slow
def test_a_failing_rank_ends_the_run_naming_it(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    overrides = [*QUICK, "training.max_steps=3", f"reward._target_={PLUGINS}.failing_on_rank_one_reward"]
    command = [*TORCHRUN, "--nproc-per-node=2", "-m", "retrain", *overrides, f"hydra.run.dir={run_dir}"]
    started = time.monotonic()
    result = subprocess.run(command, cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert time.monotonic() - started < 120  # rank 0 learns of it at the step's gather, not at the 30-minute timeout
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "failed"
    assert status["error"].startswith("rank 1: reward tests.plugins.training_plugins.failing_on_rank_one_reward")
    assert "rank 1: reward" in (run_dir / "run.log").read_text()
    # what the job returned names the same cause, not rank 0's "Connection closed by peer"
    exit_error = json.loads((run_dir / "exit.json").read_text())["error"]
    assert exit_error.startswith("RankFailed: rank 1: reward tests.plugins.training_plugins.failing_on_rank_one_reward")


def test_rank_0_raises_the_failed_ranks_error_as_the_runs(tmp_path: Path) -> None:
    notes = tmp_path / NOTES / "launch"
    notes.mkdir(parents=True)
    (notes / "rank1.failed").write_text("ValueError: bad reward\n")
    line = "rank 1: ValueError: bad reward (rank 0: RuntimeError)"
    with (
        pytest.raises(RankFailed, match=re.escape(line)),
        rank_failures_recorded(tmp_path, World(rank=0, size=2), "launch"),
    ):
        raise RuntimeError("Connection closed by peer")
    assert RunDir(tmp_path).read_status()["error"] == line


def test_a_failing_ranks_note_masks_a_url_password(tmp_path: Path) -> None:
    """The note rank 0 reads (`ranks/<launch>/rank<r>.failed`) keeps no secret the error quoted."""
    url = "http://user:p@ss-41c2@10.0.0.2:8000/v1"
    with pytest.raises(ConnectionError), rank_failures_recorded(tmp_path, World(rank=1, size=2), "launch-1"):
        raise ConnectionError(f"no server answers (GET {url})")
    note = (tmp_path / "ranks" / "launch-1" / "rank1.failed").read_text()
    assert "GET http://***@10.0.0.2:8000/v1" in note and "ss-41c2" not in note, note
