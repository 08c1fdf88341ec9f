"""A two-rank run (gloo on CPU) samples, scores and trains the quickstart's first step as one process does, started
by torchrun or as a submitit job of two tasks (the route of hydra/launcher=slurm, here on this machine)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.conftest import QUICK, checked, cli_env, read_metrics, run_cli
from tests.distributed import TORCHRUN

# with a held-out evaluation before and after training (split across ranks too)
STEPS = [
    *(o for o in QUICK if not o.startswith("eval.")),
    "eval.num_examples=16",
    "training.max_steps=2",
    "logging.generations_per_step=64",
]


def generations(run_dir: Path, step: int) -> list[tuple[str, float]]:
    lines = (run_dir / "emergence" / "generations.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    return [(r["completion"], r["reward"]) for r in records if r["step"] == step]


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("one") / "run"
    run_cli([*STEPS, f"hydra.run.dir={run_dir}"], cwd=run_dir.parent)
    return run_dir


def assert_first_step_as_one(two: Path, one: Path) -> None:
    assert generations(two, 0) == generations(one, 0)  # the same completions, rewarded the same
    first_one, first_two = read_metrics(one)[0], read_metrics(two)[0]
    for key in ("mean_reward", "num_datums", "num_tokens", "mean_completion_tokens"):
        assert first_two[key] == first_one[key], key
    for key in ("loss", "grad_norm"):
        assert first_two[key] == pytest.approx(first_one[key], abs=1e-6), key
    assert first_two["dist/world_size"] == 2
    assert first_two["dist/sample_time_max_s"] >= first_two["dist/sample_time_min_s"] > 0
    assert first_two["dist/gather_time_s"] > 0 and first_two["dist/allreduce_time_s"] > 0
    status, expected = (json.loads((run / "status.json").read_text()) for run in (two, one))
    assert status["state"] == "done"
    before = {key: value for key, value in status["eval"].items() if key.startswith("eval/before_")}
    assert before == {key: expected["eval"][key] for key in before} and len(before) == 2
    assert "rank 1" not in (two / "run.log").read_text()  # rank 0 alone writes run.log


@pytest.mark.slow
def test_two_ranks_sample_and_train_the_first_step_as_one(one_rank: Path, tmp_path: Path) -> None:
    # no hydra.run.dir: each rank's Hydra names a time-stamped dir, and the ranks must settle on rank 0's
    command = [*TORCHRUN, "--nproc-per-node=2", "-m", "retrain", *STEPS]
    checked(subprocess.run(command, cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=600))
    (two,) = (tmp_path / "outputs" / "runs").glob("*/*")  # one run dir, written by rank 0
    assert_first_step_as_one(two, one_rank)


@pytest.mark.slow
def test_a_submitit_job_of_two_tasks_is_one_run_on_two_ranks(one_rank: Path, tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    launch = ["--multirun", "hydra/launcher=local", "hydra.launcher.tasks_per_node=2", f"hydra.sweep.dir={sweep}"]
    # a stale rendezvous variable inherited from the submitting process (vLLM-CPU run in it sets LOCAL_WORLD_SIZE)
    # gives way to the job's own
    run_cli([*launch, *STEPS], cwd=tmp_path, env={"LOCAL_WORLD_SIZE": "1"})
    (two,) = (path for path in sweep.iterdir() if (path / "metrics.jsonl").is_file())
    assert_first_step_as_one(two, one_rank)
