"""Looking at a run: held-out accuracy during training (eval.every) and the learning-curve PNG beside
metrics.jsonl, drawn by a real run and from hand-made records."""

from __future__ import annotations

import json
from pathlib import Path

from matplotlib.image import imread

from retrain.training.learning_curve import LEARNING_CURVE_PNG, held_out_points, trailing_mean, write_learning_curve
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
