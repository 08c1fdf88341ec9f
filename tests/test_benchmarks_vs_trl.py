"""benchmarks/vs_trl.py reads both sides' step records and aggregates their ratios as it says, and its
shipped questions fit its model (the benchmark itself runs by hand: it trains for minutes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks._small64 import write_model
from benchmarks.vs_trl import (
    GSM8K_QUESTIONS,
    Measured,
    retrain_measured,
    round_line,
    steady,
    summary_line,
    trl_measured,
)
from retrain.config_checks.validation import check_prompt_lengths
from retrain.data.config import Gsm8kDataConfig
from retrain.data.gsm8k import Gsm8kData
from retrain.model.spec import ModelSpec


def test_retrain_metrics_are_read_in_step_order(tmp_path: Path) -> None:
    records = [
        {
            "step": step,
            "step_time_s": time,
            "mean_completion_tokens": tokens,
            "num_datums": datums,
            "batch_size": 8,
            "group_size": 8,
            "loss": 0.0,
        }
        for step, time, tokens, datums in [(1, 0.2, 6.0, 32), (0, 1.5, 5.0, 64)]
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    assert retrain_measured(tmp_path / "metrics.jsonl") == Measured(
        step_time_s=[1.5, 0.2], completion_tokens=[5.0, 6.0], rows_trained=[1.0, 0.5]
    )


def test_trl_trains_every_row(tmp_path: Path) -> None:
    (tmp_path / "out.json").write_text(json.dumps({"step_time_s": [2.0, 0.5], "completion_tokens": [5.5, 6.5]}))
    assert trl_measured(tmp_path / "out.json").rows_trained == [1.0, 1.0]


def test_steady_state_leaves_out_the_warmup() -> None:
    assert steady([9.0, 1.0, 2.0], warmup=1) == 1.5
    with pytest.raises(ValueError, match="raise --steps"):
        steady([9.0, 1.0], warmup=2)


def test_summary_is_median_and_spread_of_the_rounds() -> None:
    assert summary_line("small64", [0.40, 0.30, 0.36, 0.50]) == "retrain/TRL small64 median 0.38 min 0.30 max 0.50"


def test_round_line_ratio_uses_steady_means() -> None:
    retrain = Measured(step_time_s=[5.0, 0.1, 0.3], completion_tokens=[8, 6, 6], rows_trained=[1.0, 0.5, 1.0])
    trl = Measured(step_time_s=[9.0, 0.5, 0.5], completion_tokens=[8, 6, 7], rows_trained=[1.0, 1.0, 1.0])
    line = round_line("quickstart", 2, retrain, trl, warmup=1)
    assert line == (
        "quickstart round 2: retrain 0.200 s/step, TRL 0.500 s/step, ratio 0.40 | tokens/completion "
        "6.0 vs 6.5 | rows trained 75% vs 100%"
    )


def test_retrain_reads_the_sampler_gap_of_the_steps_that_trained(tmp_path: Path) -> None:
    record = {"step_time_s": 0.1, "mean_completion_tokens": 6.0, "num_datums": 8, "batch_size": 8, "group_size": 8}
    records = [{**record, "step": 0}, {**record, "step": 1, "engine/logprob_abs_diff": 2e-3}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert retrain_measured(tmp_path / "metrics.jsonl").sampler_gap == [2e-3]


def test_round_line_shows_both_samplers_gap_when_both_sample_with_vllm() -> None:
    retrain = Measured([0.2, 0.2], [6.0, 6.0], [1.0, 1.0], sampler_gap=[1e-6, 3e-6])
    trl = Measured([0.5, 0.5], [6.0, 6.0], [1.0, 1.0], sampler_gap=[4e-3, 2e-3])
    assert round_line("quickstart", 1, retrain, trl, warmup=1).endswith(
        "rows trained 100% vs 100% | sampler-trainer |dlogp| max 3.0e-06 vs 4.0e-03"
    )
    assert "sampler" not in round_line("quickstart", 1, retrain, Measured([0.5, 0.5], [6.0, 6.0], [1.0, 1.0]), 1)


def test_small64_gsm8k_questions_all_load_and_fit_the_small64_model(tmp_path: Path) -> None:
    """The shipped questions pass what `python -m retrain` checks before it samples (every prompt leaves
    room for the 64 new tokens in small64's context), so the workload never stops at its start."""
    data = Gsm8kData(Gsm8kDataConfig(path=str(GSM8K_QUESTIONS), held_out_split=""), seed=0)
    examples = data.next_batch(len(data))
    model = ModelSpec(name_or_path=str(write_model(tmp_path / "small64")))
    check_prompt_lengths(examples, model.load_tokenizer(), model, max_tokens=64)
    assert len(examples) == 256 and len({example.prompt for example in examples}) == 256
