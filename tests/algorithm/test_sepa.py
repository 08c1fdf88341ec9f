"""The SEPA schedule: linear ramp, auto variance tracking, the sticky correctness gate, exact resume."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from retrain.algorithm.sepa import SEPASchedule
from retrain.algorithm.tokens import MAX_UNCERTAINTY
from retrain.errors import ConfigError
from tests.algorithm.helpers import build, synthetic_step


def test_the_config_and_the_schedule_share_one_set_of_defaults():
    """SEPASettings is the single source: the schema of algorithm.sepa extends it, the schedule is built from it."""
    assert dataclasses.asdict(build("maxrl_gtpo_sepa").sepa) == dataclasses.asdict(SEPASchedule())
    assert (SEPASchedule().steps, SEPASchedule().delay_steps, SEPASchedule().gate_open) == (500, 50, False)


def test_linear_ramp_after_the_delay():
    schedule = SEPASchedule(steps=500, delay_steps=50, correct_rate_gate=0.0)
    assert [schedule.lambda_at(s) for s in (0, 50, 100, 300, 550, 9000)] == [0.0, 0.0, 0.1, 0.5, 1.0, 1.0]
    assert SEPASchedule(steps=0, correct_rate_gate=0.0).lambda_at(10_000) == 0.0


def test_the_gate_holds_lambda_at_zero_until_a_good_step_then_stays_open():
    schedule = SEPASchedule(steps=10, delay_steps=0, correct_rate_gate=0.1)
    assert schedule.lambda_at(5) == 0.0
    schedule.update(0.05, None)
    assert schedule.lambda_at(5) == 0.0 and not schedule.gate_open
    schedule.update(0.1, None)
    assert schedule.lambda_at(5) == 0.5
    schedule.update(0.0, None)
    assert schedule.gate_open and schedule.lambda_at(5) == 0.5
    schedule.update(float("nan"), None)
    assert SEPASchedule(correct_rate_gate=0.0).gate_open


def test_auto_tracks_the_execution_variance_and_floors_with_linear():
    schedule = SEPASchedule(
        steps=100, delay_steps=0, correct_rate_gate=0.0, schedule="auto", warmup=3, ema_decay=0.5, var_threshold=0.5
    )
    for variance in (4.0, 2.0, float("inf"), 2.0):
        schedule.update(1.0, variance)
    # ema: 4 -> 3 -> (inf ignored) -> 2.5; baseline fixed after the third update
    assert (schedule.var_ema, schedule.var_0, schedule.warmup_seen) == (2.5, 2.5, 3)
    assert schedule.lambda_at(10) == pytest.approx(max(0.0, 0.1))
    schedule.update(1.0, 0.0)  # ema 1.25: auto lambda = 1 - min(1.25 / 2.5 / 0.5, 1) = 0
    schedule.update(1.0, 0.0)  # ema 0.625: auto lambda = 1 - 0.5 = 0.5
    assert schedule.var_0 == 2.5 and schedule.lambda_at(10) == pytest.approx(0.5)
    assert schedule.lambda_at(90) == pytest.approx(0.9)  # linear wins


def test_auto_baseline_has_a_floor():
    schedule = SEPASchedule(schedule="auto", warmup=1, correct_rate_gate=0.0)
    schedule.update(1.0, 0.0)
    assert schedule.var_0 == 1e-8


def test_the_algorithm_feeds_auto_one_variance_per_step_from_raw_execution_tokens():
    algorithm = build(
        "maxrl_gtpo_sepa",
        "algorithm.sepa.schedule=auto",
        "algorithm.sepa.warmup=2",
        "algorithm.sepa.correct_rate_gate=0",
    )
    step = synthetic_step(groups=2, group_size=3, seed=5)
    algorithm.begin_step(0)
    algorithm.compute(step["rewards"], step["logprobs"], step["mask"], None, step["planning"])
    algorithm.end_step(0.5)
    execution = step["mask"] & ~step["planning"]
    values = (-step["logprobs"]).clamp_max(MAX_UNCERTAINTY)[execution].double()
    assert algorithm.sepa.var_ema == pytest.approx(float(values.var(correction=0)), rel=1e-5)
    assert algorithm.sepa.warmup_seen == 1


def test_without_a_sepa_transform_lambda_is_zero_and_the_schedule_never_moves():
    algorithm = build("maxrl_gtpo_hicra", "algorithm.sepa.correct_rate_gate=0", "algorithm.sepa.delay_steps=0")
    assert algorithm.begin_step(400) == {"sepa_lambda": 0.0}
    algorithm.end_step(1.0)
    assert algorithm.state_dict() == {"sepa": {"var_ema": None, "var_0": None, "warmup_seen": 0, "gate_open": True}}


def _trajectory(algorithm, steps: range) -> list[tuple[float, torch.Tensor]]:
    out = []
    for step in steps:
        lam = algorithm.begin_step(step)["sepa_lambda"]
        data = synthetic_step(groups=2, group_size=4, seed=100 + step)
        result = algorithm.compute(data["rewards"], data["logprobs"], data["mask"], None, data["planning"])
        algorithm.end_step(0.05 if step < 3 else 0.4)  # the gate opens after step 3
        out.append((lam, result.token_advantages))
    return out


@pytest.mark.parametrize("schedule", ["linear", "auto"])
def test_a_resumed_run_continues_the_schedule_exactly(schedule):
    overrides = (
        f"algorithm.sepa.schedule={schedule}",
        "algorithm.sepa.warmup=4",
        "algorithm.sepa.delay_steps=2",
        "algorithm.sepa.steps=20",
        "algorithm.sepa.ema_decay=0.6",
    )
    uninterrupted = _trajectory(build("maxrl_gtpo_sepa", *overrides), range(12))
    first = build("maxrl_gtpo_sepa", *overrides)
    before = _trajectory(first, range(6))
    checkpoint = json.loads(json.dumps(first.state_dict()))  # what trainer_state.json keeps
    resumed = build("maxrl_gtpo_sepa", *overrides)
    resumed.load_state_dict(checkpoint)
    after = _trajectory(resumed, range(6, 12))
    assert [lam for lam, _ in before + after] == [lam for lam, _ in uninterrupted]
    assert any(lam > 0 for lam, _ in after)
    for (_, got), (_, expected) in zip(before + after, uninterrupted):
        assert torch.equal(got, expected)
    assert resumed.state_dict() == json.loads(json.dumps(resumed.state_dict()))


def test_a_checkpoint_with_unknown_state_is_refused():
    with pytest.raises(ConfigError, match="unknown keys"):
        SEPASchedule().load_state_dict(
            {"var_ema": None, "var_0": None, "warmup_seen": 0, "gate_open": False, "lambda": 0.3}
        )
