"""Looking at a run: held-out accuracy during training (eval.every) and the learning-curve PNG beside
metrics.jsonl, drawn by a real run and from hand-made records."""

from __future__ import annotations

import json
from pathlib import Path

from matplotlib.image import imread

from retrain.training.learning_curve import (
    LEARNING_CURVE_PNG,
    draw_learning_curve,
    held_out_points,
    trailing_mean,
    write_learning_curve,
)
from tests.conftest import CliHere, read_metrics

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_a_run_measures_held_out_accuracy_every_n_steps_and_draws_its_curve(tmp_path: Path, cli_here: CliHere) -> None:
    run_dir = tmp_path / "run"
    overrides = ["training.max_steps=4", "training.save_every=0", "eval.num_examples=8", "eval.every=2"]
    printed = cli_here(
        ["experiment=quickstart", *overrides, "logging.progress_bar=false", f"hydra.run.dir={run_dir}"], cwd=tmp_path
    )
    records = read_metrics(run_dir)
    measured = [record["step"] for record in records if "eval/greedy_accuracy" in record]
    assert measured == [2]  # after 2 steps trained, at step 2; after 4 is the run's "after" evaluation
    assert 0 <= records[2]["eval/greedy_accuracy"] <= 1 and 0 <= records[2]["eval/sampled_accuracy"] <= 1
    assert "Held-out accuracy after 2 steps (8 problems): greedy=" in printed.stdout + printed.stderr
    status = json.loads((run_dir / "status.json").read_text())
    assert {"eval/before_greedy_accuracy", "eval/after_greedy_accuracy"} <= status["eval"].keys()
    curve = run_dir / LEARNING_CURVE_PNG
    assert curve.read_bytes().startswith(PNG_MAGIC)
    height, width, _ = imread(curve).shape
    assert width > 1.5 * height  # two panels: training and held-out


def test_held_out_points_put_before_during_and_after_on_one_axis() -> None:
    records = [{"step": 0}, {"step": 1}, {"step": 2, "eval/greedy_accuracy": 0.5, "eval/sampled_accuracy": 0.25}]
    results = {
        "eval/before_greedy_accuracy": 0.1,
        "eval/after_greedy_accuracy": 0.9,
        "eval/after_sampled_accuracy": 0.4,
    }
    assert held_out_points(records, results, max_steps=3) == {
        "greedy": [(0, 0.1), (2, 0.5), (3, 0.9)],
        "sampled": [(2, 0.25), (3, 0.4)],
    }
    assert held_out_points(records[:2], {}, max_steps=3) == {}


def test_the_curve_is_drawn_from_training_records_alone(tmp_path: Path) -> None:
    records = [{"step": n, "mean_reward": n / 10, "correct_rate": n / 20} for n in range(10)]
    path = write_learning_curve(tmp_path / "curve.png", records, {}, 10, "title")
    assert path is not None and path.read_bytes().startswith(PNG_MAGIC)
    height, width, _ = imread(path).shape
    assert width < 1.5 * height  # one panel: nothing held out was measured
    assert write_learning_curve(tmp_path / "none.png", [], {}, 10, "title") is None
    assert not (tmp_path / "none.png").exists()
    assert trailing_mean([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]


def legend_lines(records: list[dict]) -> list[tuple[str, str]]:
    """(label, line style) of each curve the training panel's legend names."""
    figure = draw_learning_curve(records, {}, len(records), "title")
    assert figure is not None
    axis = figure.axes[0]
    legend = [text.get_text() for text in axis.get_legend().get_texts()]
    lines = [
        (line.get_label(), line.get_linestyle()) for line in axis.get_lines() if not line.get_label().startswith("_")
    ]
    assert [label for label, _ in lines] == legend
    return lines


def test_a_0_1_reward_and_its_correct_rate_are_one_curve_named_for_both() -> None:
    # a 0/1 reward: the reward and the correct rate are the same numbers, so one line would hide the other
    same = [{"step": n, "mean_reward": (n % 3) / 2, "correct_rate": (n % 3) / 2} for n in range(10)]
    assert legend_lines(same) == [("reward = correct rate (they coincide)", "-")]
    # a shaped reward: two curves, the correct rate dashed so that a stretch where they meet shows both
    shaped = [
        {**record, "mean_reward": record["correct_rate"] + (0.1 if n > 5 else 0.0)} for n, record in enumerate(same)
    ]
    assert legend_lines(shaped) == [("reward", "-"), ("correct rate", "--")]
