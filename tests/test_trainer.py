"""The step as the composition root wires it, on real parts (tiny model, arithmetic, reward workers):
the backend's weight update reaches the engine and is proven fresh, sampler metrics reach every step."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
import torch

from retrain.config import compose
from retrain.inference.config import PytorchEngineConfig
from retrain.inference.pytorch import PytorchEngine
from retrain.model.probe import StaleWeightsError
from retrain.model.resources import EngineResources
from retrain.run import build_trainer
from retrain.training.trainer import Trainer
from tests.backend.tiny_model import make_backend
from tests.conftest import QUICK, SMALL_BATCH

QUICK_SMALL = [*QUICK, *SMALL_BATCH]


@pytest.fixture
def build(tmp_path: Path) -> Iterator:
    with ExitStack() as parts:

        def trainer(*overrides: str) -> Trainer:
            return build_trainer(compose([*QUICK_SMALL, *overrides]), tmp_path / "run", parts)

        yield trainer


def test_a_step_hands_the_weight_update_to_the_engine_and_proves_it_fresh(build) -> None:
    trainer = build("training.lr=0.05")
    record = trainer.train_step(0)
    assert record["num_datums"] > 0 and not record["skipped_nonfinite"]
    assert trainer.engine.weights_version == trainer.backend.weights_version == 1
    assert record["sync_time_s"] > 0 and record["train_time_s"] > 0
    assert record["step_time_s"] == pytest.approx(
        sum(v for k, v in record.items() if k.endswith("_s") and k != "step_time_s")
    )


def test_an_engine_serving_other_weights_stops_the_run(build) -> None:
    # the sampling-route check (training.logprob_diff_tolerance) would stop it first, on the rollouts: this is the probe's test
    trainer = build("training.lr=0.05", "training.logprob_diff_tolerance=inf")
    spec = trainer.backend.spec
    other = make_backend(spec, seed=1).model  # its own copy of the model, with another base weight
    with torch.no_grad():
        other.get_input_embeddings().weight.mul_(1.5)
    trainer.engine = PytorchEngine(
        PytorchEngineConfig(),
        tokenizer=trainer.engine.tokenizer,
        resources=EngineResources(spec=spec, device=trainer.backend.device, model=other),
    )
    with pytest.raises(StaleWeightsError, match="serves stale weights"):
        trainer.train_step(0)  # the adapter reaches the engine, but the probe shows other weights


def test_sampler_metrics_reach_every_step_even_one_without_signal(build) -> None:
    trainer = build("reward._target_=tests.plugins.training_plugins.never_correct_reward")
    record = trainer.train_step(0)
    assert record["num_datums"] == 0 and record["groups_skipped"] == 4 and trainer.engine.weights_version == 0
    assert record["policy/top_p_mass"] == 1.0  # quickstart samples with top_p = 1


def test_the_batching_state_is_checkpointed(build) -> None:
    trainer = build("training.max_steps=1")
    trainer.run()
    state = json.loads((trainer.run_dir / "final" / "trainer_state.json").read_text())
    assert state["batching"] == {"batch_size": 4}


def test_truncated_rows_carry_no_gradient_with_mask_truncated(build) -> None:
    partial_credit = ("reward._target_=tests.plugins.training_plugins.digit_count_reward", "training.max_tokens=2")
    plain = build(*partial_credit).train_step(0)
    assert plain["max_token_hit_rate"] > 0 and plain["num_datums"] > 0  # truncated rows are trained by default
    masked_trainer = build(*partial_credit, "training.mask_truncated=true")
    masked = masked_trainer.train_step(0)
    hit = plain["max_token_hit_rate"] * 16  # the same seed samples the same rows
    assert masked["policy/truncated_masked"] > 0
    assert masked["num_datums"] == plain["num_datums"] - masked["policy/truncated_masked"]
    assert masked["num_datums"] <= 16 - hit
    if masked["num_datums"] == 0:  # every trainable row was truncated: no update at all
        assert masked_trainer.engine.weights_version == 0 and masked["loss"] == 0.0


def test_overlong_shaping_penalises_completions_in_the_buffer(build) -> None:
    # max_tokens 8, buffer 8: every completion of |y| tokens loses |y|/8 (quickstart's match reward scores 0 or 1)
    plain = build().train_step(0)
    assert "reward/overlong_penalty_mean" not in plain  # off by default: the quickstart's metrics are unchanged
    shaped = build("training.overlong_buffer_frac=1", "training.overlong_penalty=0.5").train_step(0)
    assert shaped["reward/overlong_penalty_mean"] == pytest.approx(-0.5 * shaped["mean_completion_tokens"] / 8)
