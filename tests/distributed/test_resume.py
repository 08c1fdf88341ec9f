"""A data-parallel run's checkpoint (written by rank 0) resumes on the same number of ranks exactly, and on another
number continuing the data stream."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import QUICK, checked, cli_env, read_metrics, run_cli, without_timing
from tests.distributed import TORCHRUN

STEPS = [*QUICK, "training.save_every=2"]


def on_ranks(ranks: int, args: list[str], cwd: Path) -> None:
    command = [*TORCHRUN, f"--nproc-per-node={ranks}", "-m", "retrain", *args]
    checked(subprocess.run(command, cwd=cwd, env=cli_env(), capture_output=True, text=True, timeout=600))


def without_world(records: list[dict]) -> list[dict]:
    """Metrics minus wall-clock fields and dist/* (a run on one rank has none)."""
    return [{k: v for k, v in r.items() if not k.startswith("dist/")} for r in without_timing(records)]


@pytest.mark.slow
def test_two_ranks_resume_on_two_exactly_and_on_one_continuing_the_data(tmp_path: Path) -> None:
    whole, halves, one = tmp_path / "whole", tmp_path / "halves", tmp_path / "one"
    on_ranks(2, [*STEPS, "training.max_steps=4", f"hydra.run.dir={whole}"], tmp_path)
    on_ranks(2, [*STEPS, "training.max_steps=2", f"hydra.run.dir={halves}"], tmp_path)
    shutil.copytree(halves, one)
    on_ranks(2, [*STEPS, "training.max_steps=4", f"hydra.run.dir={halves}"], tmp_path)
    run_cli([*STEPS, "training.max_steps=4", f"hydra.run.dir={one}"], cwd=tmp_path)

    assert without_timing(read_metrics(halves)) == without_timing(read_metrics(whole))
    # one rank continues the same data stream from the same weights: the same prompts; the rollouts agree as far
    # as one process's sums agree with two ranks' (float rounding in the loss and gradient)
    continued, expected = read_metrics(one), read_metrics(whole)
    assert [r["step"] for r in continued] == [0, 1, 2, 3]
    assert "dist/world_size" not in continued[2]
    assert without_world(continued[:2]) == without_world(expected[:2])  # restored from the 2-rank run's logs
    for key in ("mean_reward", "num_tokens"):
        assert continued[2][key] == expected[2][key], key
