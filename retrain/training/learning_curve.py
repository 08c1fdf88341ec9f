"""A run's learning curve as a PNG beside its metrics.jsonl: look, don't read.

Two panels: the training reward and correct rate per step (raw, faint, and a trailing mean; with a 0/1
reward they are the same numbers, drawn once and labelled so, where one line would hide the other), and the
held-out accuracy (greedy and sampled) wherever it was measured: before training (step 0), after every
`eval.every` steps (step N's record holds the one after N steps trained) and after training (at max_steps).
matplotlib is imported when a curve is drawn, through its object API and the Agg canvas: no display, and no
change to the pyplot backend of a process (a notebook) that runs training in-process.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure

LEARNING_CURVE_PNG = "learning_curve.png"
TRAINING_CURVES = (("mean_reward", "reward"), ("correct_rate", "correct rate"))
LINE_STYLES = ("-", "--")  # reward solid, correct rate dashed: where they overlap for a stretch, both show
HELD_OUT = ("greedy", "sampled")


def trailing_mean(values: list[float], window: int) -> list[float]:
    """The mean of each value and the up to `window - 1` values before it (per-step rates of a small batch are noisy)."""
    return [sum(values[max(0, i - window + 1) : i + 1]) / (i + 1 - max(0, i - window + 1)) for i in range(len(values))]


def held_out_points(
    records: list[dict[str, Any]], eval_results: dict[str, float], max_steps: int
) -> dict[str, list[tuple[int, float]]]:
    """(steps trained, accuracy) per kind of held-out accuracy, in step order."""
    points: dict[str, list[tuple[int, float]]] = {kind: [] for kind in HELD_OUT}
    for kind in HELD_OUT:
        if (before := eval_results.get(f"eval/before_{kind}_accuracy")) is not None:
            points[kind].append((0, before))
        points[kind] += [
            (int(r["step"]), float(r[f"eval/{kind}_accuracy"]))
            for r in records
            if isinstance(r.get(f"eval/{kind}_accuracy"), (int, float))
        ]
        if (after := eval_results.get(f"eval/after_{kind}_accuracy")) is not None:
            points[kind].append((max_steps, after))
    return {kind: found for kind, found in points.items() if found}


def training_curves(records: list[dict[str, Any]]) -> list[tuple[str, list[tuple[int, float]]]]:
    """(label, (step, value) points) per curve of the training panel. Reward and correct rate are one curve,
    labelled as both, when every step has the same value for them (a 0/1 reward): drawn twice, the second
    line would hide the first and the legend would name a curve nobody can see."""
    curves = [
        (
            label,
            [
                (int(r["step"]), float(r[key]))
                for r in records
                if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])
            ],
        )
        for key, label in TRAINING_CURVES
    ]
    (reward_label, reward), (correct_label, correct) = curves
    if reward and reward == correct:
        return [(f"{reward_label} = {correct_label} (they coincide)", reward)]
    return [(label, points) for label, points in curves if points]


def draw_learning_curve(
    records: list[dict[str, Any]], eval_results: dict[str, float], max_steps: int, title: str
) -> Figure | None:
    """The figure (on an Agg canvas); None when there is nothing to draw yet."""
    held_out = held_out_points(records, eval_results, max_steps)
    if not records and not held_out:
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    panels = 2 if held_out else 1
    figure = Figure(figsize=(6 * panels, 4.2))
    FigureCanvasAgg(figure)
    axes = figure.subplots(1, panels, squeeze=False)[0]
    window = max(1, round(len(records) / 20))
    for index, (label, points) in enumerate(training_curves(records)):
        steps, values = zip(*points)
        color, style = f"C{index}", LINE_STYLES[index]
        axes[0].plot(steps, values, color=color, linestyle=style, alpha=0.25, linewidth=0.8)
        smoothed = f"{label} (mean of {window} steps)" if window > 1 else label
        axes[0].plot(steps, trailing_mean(list(values), window), color=color, linestyle=style, label=smoothed)
    axes[0].set(xlabel="step", ylabel="training batch", title="reward and correct rate")
    if held_out:
        for index, (kind, found) in enumerate(held_out.items()):
            steps, values = zip(*found)
            axes[1].plot(steps, values, marker="o", color=f"C{index + 2}", label=f"{kind} accuracy")
        axes[1].set(xlabel="steps trained", ylabel="held-out accuracy", title="held-out accuracy", ylim=(0, 1))
    for axis in axes:
        axis.grid(alpha=0.3)
        axis.legend(loc="best", fontsize=8)
    figure.suptitle(title)
    figure.tight_layout()
    return figure


def write_learning_curve(
    path: Path, records: list[dict[str, Any]], eval_results: dict[str, float], max_steps: int, title: str
) -> Path | None:
    """Draw the curve into `path` (replaced whole); None when there is nothing to draw yet."""
    figure = draw_learning_curve(records, eval_results, max_steps, title)
    if figure is None:
        return None
    temporary = path.with_name(f".{path.name}.tmp")
    figure.savefig(temporary, dpi=110, format="png")
    temporary.replace(path)
    return path
