"""Ranks launched with settings that change their work, or reading other data, are refused before training, naming
what differs; a rank-local setting may differ (retrain/distributed/agreement.py)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from retrain.commands.explain import composed
from retrain.distributed.agreement import rank_settings
from tests.conftest import QUICK, cli_env
from tests.distributed import TORCHRUN

PER_RANK = str(Path(__file__).with_name("per_rank.py"))


def on_two_ranks(args: list[str], cwd: Path, rank1: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """A 2-rank torchrun launch of `args`, rank 1 with its own overrides or working directory (per_rank.py)."""
    command = [*TORCHRUN, "--nproc-per-node=2", PER_RANK, *QUICK, *args]
    env = {**cli_env(), **rank1}
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_every_setting_but_the_rank_local_ones_is_compared() -> None:
    settings = rank_settings(composed(["experiment=quickstart"]))
    assert {"eval.every", "eval.samples", "eval.num_examples", "training.max_steps", "data.num_examples"} <= set(
        settings
    )
    local = [key for key in settings if key.startswith("logging.") or key in ("training.threads", "scoring.workers")]
    assert not local


def test_a_rank_with_another_eval_every_or_max_steps_is_refused_naming_them(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    overrides = {"RANK1_OVERRIDES": "eval.every=2 training.max_steps=7"}
    args = ["training.max_steps=3", "eval.num_examples=16", f"hydra.run.dir={run_dir}"]
    result = on_two_ranks(args, tmp_path, overrides)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "eval.every=0 on rank 0 but 2 on rank 1" in output
    assert "training.max_steps=3 on rank 0 but 7 on rank 1" in output
    assert not (run_dir / "checkpoints").exists()  # refused before training


def test_ranks_reading_other_files_at_one_relative_path_are_refused(tmp_path: Path) -> None:
    for name, answer in (("a", "4"), ("b", "5")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "problems.jsonl").write_text(
            "".join(json.dumps({"question": f"{i} + 2 + 2?", "answer": answer}) + "\n" for i in range(16))
        )
    data = ["data=jsonl", "data.path=problems.jsonl", f"hydra.run.dir={tmp_path / 'run'}"]
    result = on_two_ranks(data, tmp_path / "a", {"RANK1_CWD": str(tmp_path / "b")})
    assert result.returncode != 0
    assert "data.path='problems.jsonl': ranks [1] loaded other examples than rank 0" in result.stdout + result.stderr


@pytest.mark.slow
def test_a_rank_local_setting_may_differ(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    local = {"RANK1_OVERRIDES": "logging.generations_per_step=1 training.threads=1"}
    result = on_two_ranks(["training.max_steps=1", f"hydra.run.dir={run_dir}"], tmp_path, local)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((run_dir / "status.json").read_text())["state"] == "done"
