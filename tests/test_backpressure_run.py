"""Back-pressure end to end: `python -m retrain experiment=quickstart backpressure.enabled=true`."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from tests.conftest import read_metrics, run_cli

BACKPRESSURE = [
    "experiment=quickstart",
    "eval.num_examples=0",
    "logging.progress_bar=false",
    "backpressure.enabled=true",
    "backpressure.warmup_steps=3",
    "backpressure.max_batch_size=8",  # sweep 1, 2, 4 prompts (of 8 completions), then the fit decides
]


def run(run_dir: Path, steps: int) -> list[dict]:
    run_cli(
        [*BACKPRESSURE, f"training.max_steps={steps}", "training.save_every=3", f"hydra.run.dir={run_dir}"],
        cwd=run_dir.parent,
    )
    return read_metrics(run_dir)


def assert_sizes_follow_the_controller(records: list[dict]) -> None:
    for before, after in itertools.pairwise(records):
        assert after["batch_size"] == before["train/backpressure/next_batch_size"], (before, after)


@pytest.mark.slow
def test_quickstart_batch_size_follows_the_controller(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    records = run(run_dir, steps=5)
    assert [r["batch_size"] for r in records[:4]] == [1, 2, 4, 8]  # the sweep, then training.batch_size
    assert [r["train/backpressure/regime"] for r in records[:3]] == ["warmup"] * 3
    assert {r["train/backpressure/regime"] for r in records[3:]} <= {"retrograde", "memory_bound", "optimal"}
    assert all(r["train/backpressure/concurrency"] == r["batch_size"] * 8 for r in records)
    assert all(r["train/backpressure/throughput_tok_s"] > 0 for r in records)
    assert "train/backpressure/optimal_concurrency" in records[3]  # fitted on the sweep's three sizes
    assert_sizes_follow_the_controller(records)
    state = json.loads((run_dir / "final" / "trainer_state.json").read_text())["batching"]
    assert state["batch_size"] == records[-1]["train/backpressure/next_batch_size"]
    assert len(state["backpressure"]["window"]) == 5


@pytest.mark.slow
def test_a_resumed_run_continues_with_the_controllers_state(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    first = run(run_dir, steps=4)
    saved = json.loads((run_dir / "final" / "trainer_state.json").read_text())["batching"]
    records = run(run_dir, steps=6)  # the same run dir, two more steps: it resumes from final/
    assert records[:4] == first
    assert records[4]["batch_size"] == saved["batch_size"] == first[-1]["train/backpressure/next_batch_size"]
    assert_sizes_follow_the_controller(records)
    resumed = json.loads((run_dir / "final" / "trainer_state.json").read_text())["batching"]["backpressure"]
    assert resumed["window"][:4] == saved["backpressure"]["window"] and len(resumed["window"]) == 6
