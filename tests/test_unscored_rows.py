"""Completions the reward gives no verdict for are left out of training, and a reward that scores nothing
for `scoring.max_failing_steps` steps stops the run (real trainer: tiny model, arithmetic, reward workers)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from retrain.config import compose
from retrain.errors import RewardFailureError
from retrain.run import build_trainer
from retrain.training.trainer import Trainer
from tests.conftest import QUICK, SMALL_BATCH

QUICK_LOGGED = [*QUICK, *SMALL_BATCH, "logging.generations_per_step=16"]  # every completion of a step, with its reward
PLUGINS = "tests.plugins.training_plugins"


@pytest.fixture
def build(tmp_path: Path) -> Iterator:
    with ExitStack() as parts:

        def trainer(*overrides: str) -> Trainer:
            return build_trainer(compose([*QUICK_LOGGED, *overrides]), tmp_path / "run", parts)

        yield trainer


def test_rows_without_a_verdict_are_not_trained_on_nor_counted(build) -> None:
    trainer = build(f"reward._target_={PLUGINS}.checksum_judged_reward")
    record = trainer.train_step(0)
    logged = trainer.files.emergence_generations.read_text().splitlines()
    checksums = [sum(map(ord, json.loads(line)["completion"])) % 3 for line in logged]
    judged = [[float(c == 1) for c in checksums[start : start + 4] if c] for start in range(0, 16, 4)]
    assert record["reward/excluded"] == 16 - sum(map(len, judged)) > 0 and record["reward/errors"] == 0
    # a group trains on its judged rows only, and has signal when they disagree
    assert record["num_datums"] == sum(len(rows) for rows in judged if len(set(rows)) > 1)
    assert record["correct_rate"] == sum(map(sum, judged)) / sum(map(len, judged))


def test_a_reward_that_never_answers_stops_the_run_after_max_failing_steps(build) -> None:
    trainer = build(f"reward._target_={PLUGINS}.never_judged_reward", "scoring.max_failing_steps=2")
    first = trainer.train_step(0)
    assert (first["reward/excluded"], first["num_datums"], first["correct_rate"]) == (16, 0, 0.0)
    with pytest.raises(RewardFailureError, match=r"never_judged_reward scored none of the completions of 2 steps"):
        trainer.run()
    status = json.loads(trainer.files.status_file.read_text())
    assert status["state"] == "failed" and "RewardFailureError" in status["error"]
