"""The batching part: it owns each step's batch size, and its state travels in checkpoints."""

from __future__ import annotations

import json
import logging

import pytest

from retrain.training.batching import Batching, FixedBatching


def test_fixed_batching_serves_the_configured_size_whatever_a_step_measured() -> None:
    batching = FixedBatching(8)
    assert isinstance(batching, Batching)
    assert batching.observe({"step": 0, "step_time_s": 120.0, "num_tokens": 10}) == {}
    assert batching.batch_size(1) == 8


def test_fixed_batching_state_round_trips_through_json() -> None:
    saved = json.loads(json.dumps(FixedBatching(8).state_dict()))
    restored = FixedBatching(8)
    restored.load_state_dict(saved)
    assert restored.state_dict() == saved == {"batch_size": 8} and restored.batch_size(0) == 8


def test_a_run_resumed_with_a_new_batch_size_uses_it_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    resumed = FixedBatching(4)
    with caplog.at_level(logging.INFO, logger="retrain.training.batching"):
        resumed.load_state_dict({"batch_size": 8})
    assert resumed.batch_size(3) == 4 and "the checkpoint's run used 8" in caplog.text
