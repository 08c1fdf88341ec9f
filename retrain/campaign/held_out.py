"""Held-out accuracy of a sweep's runs, and its statistics across seeds per condition.

The training batches' `correct_rate` measures problems a run trains on; held-out accuracy measures
problems it never sees, greedy and sampled: before training and after it (status.json's `eval`,
`eval/{before,after}_{kind}_accuracy`) and, with `eval.every`, during it (`eval/{kind}_accuracy` in
the metrics record of the step it was measured after; the step is read from that record as written).
Each accuracy is a share of judged completions, whose count the run does not record: the figures are
compared per seed (means, t-intervals, Welch's test), never pooled into Fisher's test.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from retrain.campaign.runs import RunInfo
from retrain.campaign.stats import estimate, finite_number, welch_t

KINDS = ("greedy", "sampled")


@dataclass
class HeldOut:
    """One run's held-out accuracy per kind: before and after training, and at each periodic eval point."""

    before: dict[str, float] = field(default_factory=dict)
    after: dict[str, float] = field(default_factory=dict)
    points: dict[str, dict[int, float]] = field(default_factory=dict)  # kind -> {recorded step: accuracy}

    def measured(self) -> bool:
        return bool(self.before or self.after or self.points)


def held_out(run: RunInfo) -> HeldOut:
    """What `run` measured; a figure that is no finite number (NaN, a string) is skipped."""
    found = HeldOut()
    for kind in KINDS:
        for when, into in (("before", found.before), ("after", found.after)):
            if (value := finite_number(run.eval.get(f"eval/{when}_{kind}_accuracy"))) is not None:
                into[kind] = value
        points = {
            int(step): value
            for record in run.metrics
            if (value := finite_number(record.get(f"eval/{kind}_accuracy"))) is not None
            and (step := finite_number(record.get("step"))) is not None
        }
        if points:
            found.points[kind] = dict(sorted(points.items()))
    return found


def _gain(scores: HeldOut, kind: str) -> float | None:
    if kind in scores.before and kind in scores.after:
        return scores.after[kind] - scores.before[kind]
    return None


def condition_held_out(
    own: list[HeldOut], baseline: list[HeldOut] | None, confidence: float
) -> dict[str, dict[str, Any]]:
    """Per kind measured by any of `own` (a condition's finished seeds): estimates of before, after, their
    per-seed gain and each eval point, and Welch's test of `after` against `baseline`'s seeds (None for the
    baseline itself, or with no baseline)."""
    rows: dict[str, dict[str, Any]] = {}
    for kind in KINDS:
        if not any(kind in s.before or kind in s.after or kind in s.points for s in own):
            continue
        steps = sorted({step for s in own for step in s.points.get(kind, {})})
        rows[kind] = {
            "before": estimate([s.before.get(kind) for s in own], confidence).to_json(),
            "after": estimate([s.after.get(kind) for s in own], confidence).to_json(),
            "gain": estimate([_gain(s, kind) for s in own], confidence).to_json(),
            "points": [
                {"step": step, **estimate([s.points.get(kind, {}).get(step) for s in own], confidence).to_json()}
                for step in steps
            ],
            "welch_vs_baseline": None
            if baseline is None
            else welch_t([s.after.get(kind) for s in own], [s.after.get(kind) for s in baseline]).to_json(),
        }
    return rows
