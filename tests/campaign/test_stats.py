"""Campaign statistics against scipy on the same numbers, and on simulated runs' raw draws."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats as scipy_stats

from retrain.campaign.stats import estimate, fisher_exact, run_scores, welch_t
from retrain.housekeeping.rundir import RunDir
from tests.campaign.rundirs import simulate_run

values = st.lists(st.floats(min_value=-1e3, max_value=1e3, allow_nan=False), min_size=2, max_size=12)


@settings(max_examples=60, deadline=None)
@given(values, st.sampled_from([0.8, 0.9, 0.95, 0.99]))
def test_interval_is_scipys_t_interval_and_contains_the_mean(sample: list[float], confidence: float) -> None:
    result = estimate(sample, confidence)
    assert result.n == len(sample)
    assert result.mean == pytest.approx(float(np.mean(sample)), abs=1e-9)
    assert result.std == pytest.approx(float(np.std(sample, ddof=1)), abs=1e-9)
    assert result.ci_low <= result.mean <= result.ci_high
    if result.std > 0:
        low, high = scipy_stats.t.interval(
            confidence, len(sample) - 1, loc=np.mean(sample), scale=scipy_stats.sem(sample)
        )
        assert (result.ci_low, result.ci_high) == (pytest.approx(low, abs=1e-6), pytest.approx(high, abs=1e-6))


@settings(max_examples=30, deadline=None)
@given(values)
def test_a_wider_confidence_gives_a_wider_interval(sample: list[float]) -> None:
    narrow, wide = estimate(sample, 0.8), estimate(sample, 0.99)
    assert wide.ci_high - wide.ci_low >= narrow.ci_high - narrow.ci_low


def test_degenerate_samples_say_so() -> None:
    assert estimate([]).mean is None and estimate([]).text() == "—"
    single = estimate([0.4])
    assert (single.n, single.mean, single.std, single.ci_low) == (1, 0.4, None, None)
    assert "n=1" in single.text()
    assert estimate([0.1, float("nan"), 0.3]).n == 2  # non-finite values are not scores


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 60), st.integers(1, 60), st.integers(0, 60), st.integers(1, 60))
def test_fisher_matches_scipy(c1: int, extra1: int, c0: int, extra0: int) -> None:
    t1, t0 = c1 + extra1, c0 + extra0
    ours = fisher_exact(c1, t1, c0, t0)
    theirs = scipy_stats.fisher_exact([[c1, t1 - c1], [c0, t0 - c0]])
    assert ours.p_value == pytest.approx(float(theirs.pvalue))
    if not math.isnan(theirs.statistic):
        assert ours.statistic == pytest.approx(float(theirs.statistic))


def test_welch_matches_scipy_and_refuses_too_few_seeds() -> None:
    rng = np.random.default_rng(0)
    a, b = list(rng.normal(0.5, 0.1, 5)), list(rng.normal(0.3, 0.2, 4))
    ours = welch_t(a, b)
    theirs = scipy_stats.ttest_ind(a, b, equal_var=False)
    assert ours.statistic == pytest.approx(float(theirs.statistic))
    assert ours.p_value == pytest.approx(float(theirs.pvalue))
    assert welch_t([0.5], b).p_value is None and "2 seeds" in welch_t([0.5], b).note
    assert welch_t([0.5, 0.5], [0.2, 0.2]).p_value is None  # no variance anywhere: no test


def test_run_scores_recount_the_simulated_draws(tmp_path: Path) -> None:
    run = simulate_run(tmp_path, "maxrl_gtpo_sepa", seed=7, p_correct=0.4, steps=15)
    files = RunDir(run.dir)
    scores = run_scores(files.metrics_records(), last_k=5)
    tail = run.draws[-5:]
    assert scores.steps == 15
    assert scores.final == pytest.approx(float(run.draws[-1].mean()))
    assert scores.last_k == pytest.approx(float(tail.mean(axis=1).mean()))
    assert (scores.correct, scores.total) == (int(tail.sum()), tail.size)
    assert scores.entropy_var == pytest.approx(float(run.entropy_var[-5:].mean()))
    # a torn last line (the trainer is appending right now) is skipped, not an error
    with open(files.metrics, "a") as handle:
        handle.write(json.dumps({"step": 15, "correct_rate": 1.0})[:-7])
    assert run_scores(files.metrics_records(), last_k=5).steps == 15
