"""`logging.tensorboard=true`: a real run's TensorBoard event files hold, per step, the numbers wandb gets
under the same keys, read back with TensorBoard's own reader."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from retrain.errors import ConfigError
from retrain.training.metrics_log import TENSORBOARD_DIR, check_tensorboard, logged_scalars
from tests.conftest import CliHere, read_metrics, run_cli
from tests.wandb_records import offline_history

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


def test_a_run_writes_every_step_under_wandbs_keys(tmp_path: Path, cli_here: CliHere) -> None:
    run_dir = tmp_path / "run"
    overrides = ["training.max_steps=3", "eval.num_examples=8", "logging.tensorboard=true", "training.kl_coef=0.01"]
    cli_here(
        ["experiment=quickstart", *overrides, "logging.progress_bar=false", f"hydra.run.dir={run_dir}"], cwd=tmp_path
    )
    events = event_accumulator.EventAccumulator(str(run_dir / TENSORBOARD_DIR), size_guidance={"scalars": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    records = read_metrics(run_dir)
    for record in records:
        expected = logged_scalars(record)
        assert expected.keys() <= tags
        for key, value in expected.items():
            logged = {scalar.step: scalar.value for scalar in events.Scalars(key)}
            assert logged[record["step"]] == pytest.approx(value, rel=1e-6, abs=1e-6), key
    assert {"train/correct_rate", "train/mean_reward", "train/loss", "train/policy/kl"} <= tags
    before = events.Scalars("eval/before_greedy_accuracy")
    after = events.Scalars("eval/after_sampled_accuracy")
    assert [scalar.step for scalar in before] == [0] and [scalar.step for scalar in after] == [3]
    assert tags - {key for record in records for key in logged_scalars(record)} == {
        "eval/before_greedy_accuracy",
        "eval/before_sampled_accuracy",
        "eval/after_greedy_accuracy",
        "eval/after_sampled_accuracy",
    }


def test_without_the_package_the_setting_is_refused_naming_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    check_tensorboard(False)
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if it were not installed: its import fails
    with pytest.raises(ConfigError, match=r"logging.tensorboard=true needs the tensorboard package: .*\[tensorboard\]"):
        check_tensorboard(True)


def test_held_out_accuracy_after_n_steps_is_at_step_n_everywhere(tmp_path: Path) -> None:
    """One x-axis, steps trained: eval.every=2 measures after 2 steps; metrics.jsonl, TensorBoard, wandb and the
    console all put it at step 2, with before at 0 and after at max_steps."""
    run_dir = tmp_path / "run"
    overrides = ["training.max_steps=3", "eval.num_examples=4", "eval.every=2", "logging.tensorboard=true"]
    printed = run_cli(
        ["experiment=quickstart", *overrides, "logging.wandb_project=retrain-test", f"hydra.run.dir={run_dir}"],
        cwd=tmp_path,
        env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"},
    ).stdout
    records = read_metrics(run_dir)
    assert [r["step"] for r in records if "eval/greedy_accuracy" in r] == [2]
    events = event_accumulator.EventAccumulator(str(run_dir / TENSORBOARD_DIR), size_guidance={"scalars": 0})
    events.Reload()
    assert [scalar.step for scalar in events.Scalars("eval/greedy_accuracy")] == [2]
    assert [scalar.step for scalar in events.Scalars("eval/before_greedy_accuracy")] == [0]
    assert [scalar.step for scalar in events.Scalars("eval/after_greedy_accuracy")] == [3]
    [run_file] = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    assert [h["_step"] for h in offline_history(run_file) if "eval/greedy_accuracy" in h] == [2]
    lines = printed.splitlines()
    measured = next(i for i, line in enumerate(lines) if line.startswith("Held-out accuracy after 2 steps"))
    assert next(line for line in lines[measured:] if line.startswith("Step ")).startswith("Step 2 [")
