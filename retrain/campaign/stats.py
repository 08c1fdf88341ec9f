"""Statistics across seeds: means with t-intervals, Fisher's exact test on pooled counts, Welch's t-test.

Seeds are the unit of replication: a condition's score is one number per seed (its final or last-k
correct rate), and intervals and Welch's test treat those numbers as the sample. Fisher's exact test
instead pools every scored completion of the last k steps, which asks a different question (is the
per-completion success rate different?) and is reported next to it, not instead of it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from scipy import stats

CORRECT_RATE = "correct_rate"
ENTROPY_VAR = "exec_entropy_var"


@dataclass
class Estimate:
    """Mean of n values with sample std and a two-sided t confidence interval (None when n < 2)."""

    n: int
    mean: float | None
    std: float | None
    ci_low: float | None
    ci_high: float | None
    confidence: float = 0.95

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def text(self, digits: int = 3) -> str:
        if self.mean is None:
            return "—"
        if self.std is None:
            return f"{self.mean:.{digits}f} (n=1)"
        return f"{self.mean:.{digits}f} ± {self.std:.{digits}f} [{self.ci_low:.{digits}f}, {self.ci_high:.{digits}f}]"


def estimate(values: Sequence[float | None], confidence: float = 0.95) -> Estimate:
    """Skips None (a run without that score) and non-finite values."""
    finite = [float(v) for v in values if v is not None and math.isfinite(v)]
    n = len(finite)
    if n == 0:
        return Estimate(0, None, None, None, None, confidence)
    mean = sum(finite) / n
    if n == 1:
        return Estimate(1, mean, None, None, None, confidence)
    std = math.sqrt(sum((v - mean) ** 2 for v in finite) / (n - 1))
    half = float(stats.t.ppf(0.5 + confidence / 2, df=n - 1)) * std / math.sqrt(n)
    return Estimate(n, mean, std, mean - half, mean + half, confidence)


@dataclass
class TestResult:
    statistic: float | None  # odds ratio (Fisher) or t (Welch)
    p_value: float | None
    note: str = ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def text(self, name: str) -> str:
        if self.p_value is None:
            return f"{name}: n/a ({self.note})" if self.note else f"{name}: n/a"
        return f"{name}={_fmt(self.statistic)}, p={self.p_value:.3g}"


def _fmt(value: float | None) -> str:
    if value is None:
        return "—"
    return "inf" if math.isinf(value) else f"{value:.3g}"


def _finite(value: float) -> float | None:
    return float(value) if math.isfinite(value) else None


def fisher_exact(correct: int, total: int, base_correct: int, base_total: int) -> TestResult:
    """Two-sided Fisher's exact test of [correct, wrong] against the baseline's [correct, wrong]."""
    if total == 0 or base_total == 0:
        return TestResult(None, None, "no scored completions")
    table = [[correct, total - correct], [base_correct, base_total - base_correct]]
    result = stats.fisher_exact(table, alternative="two-sided")
    odds = float(result.statistic)
    return TestResult(odds if not math.isnan(odds) else None, float(result.pvalue))


def welch_t(values: Sequence[float | None], base_values: Sequence[float | None]) -> TestResult:
    """Welch's unequal-variance t-test of per-seed values against the baseline's (None and non-finite skipped)."""
    a = [v for v in values if v is not None and math.isfinite(v)]
    b = [v for v in base_values if v is not None and math.isfinite(v)]
    if len(a) < 2 or len(b) < 2:
        return TestResult(None, None, "needs >= 2 seeds in both conditions")
    if max(a) == min(a) and max(b) == min(b):
        return TestResult(None, None, "both conditions have zero variance across seeds")
    result = stats.ttest_ind(a, b, equal_var=False)
    return TestResult(_finite(result.statistic), _finite(result.pvalue))


@dataclass
class RunScores:
    """One run's numbers, from its per-step records."""

    final: float | None  # correct_rate of the last step
    last_k: float | None  # mean correct_rate over the last k steps
    correct: int  # completions judged correct in the last k steps
    total: int  # completions scored in the last k steps
    entropy_var: float | None  # mean exec_entropy_var over the last k steps (None if not logged)
    steps: int


def finite_number(value: Any) -> float | None:
    """`value` as a float when it is a finite real number (no bool, NaN or infinity), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def run_scores(records: list[dict[str, Any]], last_k: int) -> RunScores:
    """Scores of the steps whose `correct_rate` is a finite number; a NaN, an infinity or a missing one is skipped."""
    steps = [r for r in records if finite_number(r.get(CORRECT_RATE)) is not None]
    if not steps:
        return RunScores(None, None, 0, 0, None, 0)
    tail = steps[-last_k:]
    correct = total = 0
    for record in tail:
        completions = int(finite_number(record.get("batch_size")) or 0) * int(
            finite_number(record.get("group_size")) or 0
        )
        total += completions
        correct += round(float(record[CORRECT_RATE]) * completions)
    entropy = [value for r in tail if (value := finite_number(r.get(ENTROPY_VAR))) is not None]
    return RunScores(
        final=float(steps[-1][CORRECT_RATE]),
        last_k=sum(float(r[CORRECT_RATE]) for r in tail) / len(tail),
        correct=correct,
        total=total,
        entropy_var=sum(entropy) / len(entropy) if entropy else None,
        steps=len(steps),
    )
