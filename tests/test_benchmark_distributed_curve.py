"""benchmarks/distributed_curve.py: 1 rank vs 2 ranks per seed, the verdict, and its reproducibility check."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.distributed_curve import agreement, same_seed, summarize, windows
from tests.conftest import REPO, cli_env


def made_run(ranks: int, seed: int, rate: float, greedy: float) -> dict:
    return {
        "ranks": ranks,
        "seed": seed,
        "windows": {"0-1": rate},
        "held_out": {"eval/after_greedy_accuracy": greedy},
        "metrics": [{"step": 0, "correct_rate": rate}],
    }


def test_the_verdict_compares_the_gap_of_the_means_with_the_one_rank_seeds_range() -> None:
    runs = [made_run(1, 0, 0.4, 0.8), made_run(1, 1, 0.6, 0.9), made_run(2, 0, 0.45, 0.5), made_run(2, 1, 0.65, 0.6)]
    summary = summarize(runs, 2)
    assert summary["correct_rate 0-1"]["gap"] == pytest.approx(0.05)
    assert summary["correct_rate 0-1"]["within_seed_spread"]  # 0.05 <= 0.6 - 0.4
    assert summary["greedy held-out"]["1"]["min"] == 0.8 and summary["greedy held-out"]["2"]["max"] == 0.6
    assert not summary["greedy held-out"]["within_seed_spread"]  # 0.3 > 0.1
    assert windows(150, 50) == [(0, 49), (50, 99), (100, 149)] and windows(2, 50) == [(0, 1)]


def test_agreement_names_the_first_step_that_differs() -> None:
    run = made_run(2, 0, 0.5, 0.5)
    assert agreement(run, run)["identical"]
    other = {**run, "metrics": [{"step": 0, "correct_rate": 0.25}]}
    assert agreement(run, other) == {
        "identical": False,
        "steps_compared": 1,
        "first_differing_step": 0,
        "held_out_identical": True,
    }


def test_same_seed_compares_a_seeds_runs_on_one_and_on_n_ranks_step_by_step() -> None:
    records = [{"step": n, "correct_rate": 0.5, "loss": 0.1, "grad_norm": 1.0} for n in range(3)]
    one = {"metrics": records, "held_out": {"eval/after_greedy_accuracy": 0.5}}
    many_records = [{**r, "dist/world_size": 2} for r in records]
    many_records[2] = {**many_records[2], "loss": 0.125, "correct_rate": 0.75}
    many = {"metrics": many_records, "held_out": one["held_out"]}
    assert same_seed(one, many) == {
        "first_differing_step": 2,  # dist/ fields are left out
        "same_correct_rate_steps": 2,
        "steps": 3,
        "max_abs_diff": {"loss": pytest.approx(0.025), "grad_norm": 0.0},
        "held_out_identical": True,
    }


@pytest.mark.slow  # three retrain runs of 2 steps, two of them on 2 ranks: ~1-2 min on 2 cores
def test_the_script_runs_both_world_sizes_and_repeats_a_seed(tmp_path: Path) -> None:
    out = tmp_path / "curve.json"
    options = ["--seeds", "3", "--steps", "2", "--out", str(out), "eval.num_examples=8", "eval.samples=2"]
    result = subprocess.run(
        [sys.executable, "benchmarks/distributed_curve.py", *options],
        cwd=REPO,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [(r["seed"], r["ranks"], r["repeat"]) for r in report["runs"]] == [
        (3, 1, False),
        (3, 2, False),
        (3, 2, True),
    ]
    for run in report["runs"]:
        assert len(run["curve"]) == 2 and list(run["windows"]) == ["0-1"]
        assert {"eval/after_greedy_accuracy", "eval/after_sampled_accuracy"} <= run["held_out"].keys()
    assert set(report["summary"]) == {"correct_rate 0-1", "greedy held-out", "sampled held-out"}
    assert report["reproduced"] == {
        "seed": 3,
        "ranks": 2,
        "identical": True,
        "steps_compared": 2,
        "first_differing_step": None,
        "held_out_identical": True,
    }
    compared = report["one_vs_many"]["3"]
    assert compared["steps"] == 2 and compared["same_correct_rate_steps"] >= 1
    assert compared["max_abs_diff"]["loss"] < 1e-4  # the first step trains alike on 1 and 2 ranks
    first_one, first_two = report["first_step_correct_rate"]["3"]
    assert first_one == first_two  # the first step is sampled alike on 1 and 2 ranks
    assert "seed 3 on 2 ranks, run twice: identical metrics and held-out results" in result.stdout
