"""Learning curves of a sweep and its held-out accuracy: per condition, the mean over seeds with a ±1 std band."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: jobs run headless
import matplotlib.pyplot as plt

from retrain.campaign.held_out import KINDS, held_out
from retrain.campaign.runs import RunInfo
from retrain.campaign.stats import CORRECT_RATE, ENTROPY_VAR

CURVES_PNG = "learning_curves.png"
HELD_OUT_PNG = "held_out_accuracy.png"
PANELS = [
    (CORRECT_RATE, "correct rate (smoothed)"),
    ("running_correct_rate", "running correct rate"),
    (ENTROPY_VAR, "execution-token entropy variance (smoothed)"),
]
SMOOTHED = {CORRECT_RATE, ENTROPY_VAR}


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average (per-step rates of a small batch are noisy)."""
    out, total, kept = [], 0.0, []
    for value in values:
        kept.append(value)
        total += value
        if len(kept) > window:
            total -= kept.pop(0)
        out.append(total / len(kept))
    return out


def series(run: RunInfo, metric: str, window: int) -> dict[int, float]:
    points = [
        (int(r["step"]), float(r[metric]))
        for r in run.metrics
        if isinstance(r.get(metric), (int, float)) and math.isfinite(r[metric]) and "step" in r
    ]
    if not points:
        return {}
    steps, values = zip(*points)
    return dict(zip(steps, smooth(list(values), window) if metric in SMOOTHED else list(values)))


def draw_band(axis: Any, curves: list[dict[int, float]], color: Any, label: str, **line: Any) -> None:
    """The mean curve over seeds, and ± one standard deviation shaded around it."""
    steps, means, stds = band(curves)
    axis.plot(steps, means, color=color, label=label, **line)
    lower = [m - s for m, s in zip(means, stds)]
    upper = [m + s for m, s in zip(means, stds)]
    axis.fill_between(steps, lower, upper, color=color, alpha=0.12, linewidth=0)


def band(curves: list[dict[int, float]]) -> tuple[list[int], list[float], list[float]]:
    """Mean and std over the seeds that reached each step."""
    steps = sorted(set().union(*curves))
    means, stds = [], []
    for step in steps:
        values = [c[step] for c in curves if step in c]
        mean = sum(values) / len(values)
        means.append(mean)
        stds.append(math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0)
    return steps, means, stds


def plot_learning_curves(runs: list[RunInfo], conditions: list[str], path: Path, title: str) -> Path | None:
    """Write the PNG; None when no run has logged a step yet."""
    with_metrics = [r for r in runs if r.metrics and r.condition]
    if not with_metrics:
        return None
    longest = max(len(r.metrics) for r in with_metrics)
    window = max(1, round(longest / 20))
    panels = [(m, label) for m, label in PANELS if any(series(r, m, 1) for r in with_metrics)]
    figure, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.2), squeeze=False)
    colors = plt.get_cmap("tab10")
    for axis, (metric, label) in zip(axes[0], panels):
        for index, condition in enumerate(conditions):
            curves = [c for c in (series(r, metric, window) for r in with_metrics if r.condition == condition) if c]
            if not curves:
                continue
            draw_band(axis, curves, colors(index % 10), f"{condition} (n={len(curves)})")
        axis.set_xlabel("step")
        axis.set_title(label + (f", window {window}" if metric in SMOOTHED and window > 1 else ""), fontsize=10)
        axis.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    figure.suptitle(f"{title}: mean ± std over seeds", fontsize=11)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def held_out_curve(run: RunInfo, kind: str) -> dict[int, float]:
    """Steps trained -> held-out accuracy: before training at 0, each eval point at the step its metrics record
    names, after training at the run's last step count (its max_steps)."""
    found = held_out(run)
    curve = {0: found.before[kind]} if kind in found.before else {}
    curve.update(found.points.get(kind, {}))
    if kind in found.after and run.max_steps is not None:
        curve[run.max_steps] = found.after[kind]
    return curve


def plot_held_out(runs: list[RunInfo], conditions: list[str], path: Path, title: str) -> Path | None:
    """Write the PNG (a panel per kind, greedy and sampled) from the finished runs; None when none measured
    held-out accuracy at two points or more (a lone point is no curve: the summary's table has it)."""
    done = [r for r in runs if r.state == "done" and r.condition]
    curves = {
        (condition, kind): [c for c in (held_out_curve(r, kind) for r in done if r.condition == condition) if c]
        for condition in conditions
        for kind in KINDS
    }
    kinds = [kind for kind in KINDS if any(len(c) > 1 for (_, k), found in curves.items() if k == kind for c in found)]
    if not kinds:
        return None
    figure, axes = plt.subplots(1, len(kinds), figsize=(6 * len(kinds), 4.2), squeeze=False)
    colors = plt.get_cmap("tab10")
    for axis, kind in zip(axes[0], kinds):
        for index, condition in enumerate(conditions):
            if not curves[(condition, kind)]:
                continue
            label = f"{condition} (n={len(curves[(condition, kind)])})"
            draw_band(axis, curves[(condition, kind)], colors(index % 10), label, marker="o")
        axis.set(
            xlabel="step (0: before training)",
            ylabel="held-out accuracy",
            title=f"{kind} held-out accuracy",
            ylim=(0, 1),
        )
        axis.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    figure.suptitle(f"{title}: held-out accuracy, mean ± std over finished seeds", fontsize=11)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
