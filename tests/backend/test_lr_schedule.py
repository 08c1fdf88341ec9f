"""training.lr_schedule (docs/loss.md): the factor of each optimizer step, the rate the local backend's
optimizer uses and logs, and an exact resume of the schedule from a checkpoint."""

from __future__ import annotations

import math

import pytest
import torch

from retrain.backend.local import SCHEDULER_FILE
from retrain.backend.lr_schedule import lr_factor
from retrain.backend.settings import OptimSettings
from retrain.config import TrainingConfig
from retrain.errors import ConfigError
from tests.backend.test_local_training import batch_for, lora_state, sample
from tests.backend.tiny_model import make_backend


def factors(**schedule) -> list[float]:
    settings = OptimSettings.from_config(TrainingConfig(max_steps=6, warmup_steps=2, min_lr_ratio=0.1, **schedule))
    return [lr_factor(settings)(step) for step in range(7)]


def test_linear_warmup_then_each_schedule_by_hand() -> None:
    """transformers' schedules: step / warmup during warmup, then decay over the remaining 4 steps to min_lr_ratio."""
    assert factors(lr_schedule="constant") == [0.0, 0.5, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert factors(lr_schedule="linear") == pytest.approx([0.0, 0.5, 1.0, 0.775, 0.55, 0.325, 0.1])
    cosine = [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * k / 4)) for k in range(5)]
    assert factors(lr_schedule="cosine") == pytest.approx([0.0, 0.5, *cosine])


def test_the_default_is_a_constant_rate() -> None:
    settings = OptimSettings.from_config(TrainingConfig())
    assert [lr_factor(settings)(step) for step in (0, 1, 499, 500)] == [1.0, 1.0, 1.0, 1.0]


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"lr_schedule": "step"}, "training.lr_schedule must be one of: constant, linear, cosine, got step"),
        ({"warmup_steps": -1}, "training.warmup_steps must be >= 0, got -1"),
        ({"min_lr_ratio": 1.5}, r"training.min_lr_ratio must be in \[0, 1\], got 1.5"),
    ],
)
def test_a_bad_schedule_value_names_its_key(overrides: dict, named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        OptimSettings.from_config(TrainingConfig(**overrides))


SCHEDULE = TrainingConfig(lr=1e-2, lr_schedule="cosine", warmup_steps=1, max_steps=4, min_lr_ratio=0.2)


def scheduled_backend(tiny_spec):
    return make_backend(tiny_spec, optim=OptimSettings.from_config(SCHEDULE))


def test_each_step_trains_and_logs_its_scheduled_rate(tiny_spec) -> None:
    """The first step's rate is 0 (warmup from 0): its update leaves the adapter as it was; the next use the cosine's."""
    backend = scheduled_backend(tiny_spec)
    expected = [SCHEDULE.lr * lr_factor(OptimSettings.from_config(SCHEDULE))(step) for step in range(3)]
    before = lora_state(backend)
    rates = []
    for step in range(3):
        result = backend.train(batch_for(sample(backend, seed=step), seed=step))
        rates.append(result.metrics["optim/lr"])
        if step == 0:
            assert all(torch.equal(p, before[name]) for name, p in lora_state(backend).items())
    assert rates == pytest.approx(expected) and expected[0] == 0 and expected[1] == pytest.approx(1e-2)
    assert "optim/lr" not in make_backend(tiny_spec).train(batch_for(sample(backend))).metrics  # constant: no key


def test_a_resumed_schedule_continues_exactly(tiny_spec, tmp_path) -> None:
    """Two steps, a checkpoint, two more: a fresh backend loading the checkpoint takes the same last two steps,
    rate and loss bit for bit."""
    original = scheduled_backend(tiny_spec)
    for step in range(2):
        original.train(batch_for(sample(original, seed=step), seed=step))
    original.save(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / SCHEDULER_FILE).exists()
    continued = [original.train(batch_for(sample(original, seed=step), seed=step)) for step in (2, 3)]

    restored = scheduled_backend(tiny_spec)
    restored.load(tmp_path / "ckpt")
    resumed = [restored.train(batch_for(sample(restored, seed=step), seed=step)) for step in (2, 3)]
    assert [r.metrics["optim/lr"] for r in resumed] == [r.metrics["optim/lr"] for r in continued]
    assert [r.loss for r in resumed] == [r.loss for r in continued]
    assert restored.scheduler.state_dict() == original.scheduler.state_dict()
