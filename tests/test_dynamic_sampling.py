"""DAPO's dynamic sampling on the real step (tiny model, arithmetic, reward workers): uniform groups are dropped and
refilled from the seeded data stream, and a run killed and resumed draws the same prompts as an uninterrupted one."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from retrain.config import compose
from retrain.distributed.world import World
from retrain.errors import ConfigError
from retrain.run import build_trainer, check_dynamic_sampling, plan_parts
from retrain.training.trainer import Trainer
from tests.conftest import QUICK, SMALL_BATCH, read_metrics, without_timing

ON = ["training.dynamic_sampling.enabled=true", "training.dynamic_sampling.max_draws=3"]
PARTIAL_CREDIT = "reward._target_=tests.plugins.training_plugins.even_answers_only_reward"
NEVER_CORRECT = "reward._target_=tests.plugins.training_plugins.never_correct_reward"
B = 4  # SMALL_BATCH: four prompts of four completions


@pytest.fixture
def build(tmp_path: Path) -> Iterator:
    with ExitStack() as parts:

        def trainer(*overrides: str, run: str = "run") -> Trainer:
            return build_trainer(compose([*QUICK, *SMALL_BATCH, *overrides]), tmp_path / run, parts)

        yield trainer


def test_uniform_groups_are_dropped_and_refilled_up_to_the_batch_size(build) -> None:
    record = build(PARTIAL_CREDIT, *ON).train_step(0)
    assert record["dapo/groups_drawn"] == record["dapo/draws"] * B  # every round draws B prompts
    assert record["dapo/groups_dropped"] == record["dapo/groups_drawn"] - B  # the batch holds B groups
    assert record["dapo/draws"] > 1  # the first round had uniform groups (the tiny model's completions vary little)
    informative = B - record["groups_skipped"]
    assert informative == B or record["dapo/draws"] == 4  # B groups with signal, or every extra round spent
    assert record["num_datums"] == 4 * informative  # every row of a group with signal, none of a uniform one


def test_without_signal_every_round_is_drawn_and_nothing_trained(build) -> None:
    trainer = build(NEVER_CORRECT, *ON)
    record = trainer.train_step(0)
    assert (record["dapo/draws"], record["dapo/groups_drawn"], record["dapo/groups_dropped"]) == (4, 16, 12)
    assert record["groups_skipped"] == B  # filled up with uniform groups, which train nothing
    assert record["num_datums"] == 0 and trainer.engine.weights_version == 0
    reference = build(NEVER_CORRECT, run="reference").data  # the same seeded stream, drawn by hand
    drawn = [example.id for _ in range(4) for example in reference.next_batch(B)]
    assert trainer.data.state_dict() == reference.state_dict() and len(set(drawn)) == 16


def test_off_by_default_with_the_metrics_unchanged(build) -> None:
    record = build(PARTIAL_CREDIT).train_step(0)
    assert not any(key.startswith("dapo/") for key in record)


def test_a_killed_and_resumed_run_draws_the_same_refill_prompts(tmp_path: Path) -> None:
    overrides = [*QUICK, *SMALL_BATCH, PARTIAL_CREDIT, *ON, "training.save_every=1", "training.max_steps=2"]

    def train(run_dir: Path) -> dict:
        with ExitStack() as parts:
            return build_trainer(compose(overrides), run_dir, parts).run()

    reference = tmp_path / "reference"
    assert train(reference)["state"] == "done"
    assert sum(record["dapo/draws"] for record in read_metrics(reference)) > 2  # some step refilled
    resumed = tmp_path / "resumed"
    shutil.copytree(reference, resumed)  # killed after step 0's checkpoint: step 1's records and files gone
    shutil.rmtree(resumed / "final")
    shutil.rmtree(resumed / "checkpoints" / "step_2")
    for name in ("metrics.jsonl", "emergence/steps.jsonl", "emergence/generations.jsonl"):
        lines = (resumed / name).read_text().splitlines()
        (resumed / name).write_text("".join(line + "\n" for line in lines if json.loads(line)["step"] == 0))
    assert train(resumed)["state"] == "done"
    assert without_timing(read_metrics(resumed)) == without_timing(read_metrics(reference))
    generations = "emergence/generations.jsonl"
    assert (resumed / generations).read_text() == (reference / generations).read_text()


def test_data_parallel_runs_refuse_dynamic_sampling() -> None:
    cfg = compose([*QUICK, *ON])
    check_dynamic_sampling(cfg, plan_parts(cfg), World())  # one process: accepted
    with pytest.raises(ConfigError, match="training.dynamic_sampling.enabled"):
        check_dynamic_sampling(cfg, plan_parts(cfg), World(rank=0, size=2))


def test_the_dapo_recipe_sets_the_papers_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    checkout_conf = Path(__file__).resolve().parents[1] / "conf"  # this checkout's, not an installed copy's
    monkeypatch.setattr("retrain.config.config_dir", lambda: str(checkout_conf))
    training = compose(["recipe=dapo"]).training
    assert (training.objective, training.clip_eps, training.clip_eps_high, training.loss_agg) == (
        "ppo",
        0.2,
        0.28,
        "token_mean",
    )
    assert (training.kl_coef, training.overlong_buffer_frac, training.overlong_penalty) == (0.0, 0.2, 1.0)
    assert training.dynamic_sampling.enabled
