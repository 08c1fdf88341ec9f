"""The run dir's layout is the contract with users, `retrain status` and restarts: names, choice, round trips."""

from __future__ import annotations

import json
from pathlib import Path

from retrain.rundir import RunDir


def write_adapter(directory: Path) -> None:
    (directory / "adapter_model.safetensors").write_bytes(b"weights")


def save(run_dir: RunDir, completed: int, final: bool = False) -> Path:
    state = {"completed_steps": completed, "step": completed - 1}
    return run_dir.save_checkpoint(completed, write_adapter, state, final=final).path


def test_the_layout_is_the_documented_one(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path)
    assert {
        name: getattr(run_dir, name).relative_to(tmp_path).as_posix()
        for name in (
            "status_file",
            "metrics",
            "emergence_steps",
            "emergence_generations",
            "checkpoints_dir",
            "final_dir",
            "final_adapter",
            "log_file",
            "job_file",
            "exit_file",
            "hydra_config",
            "lock_file",
        )
    } == {
        "status_file": "status.json",
        "metrics": "metrics.jsonl",
        "emergence_steps": "emergence/steps.jsonl",
        "emergence_generations": "emergence/generations.jsonl",
        "checkpoints_dir": "checkpoints",
        "final_dir": "final",
        "final_adapter": "final/adapter_model.safetensors",
        "log_file": "run.log",
        "job_file": "job.json",
        "exit_file": "exit.json",
        "hydra_config": ".hydra/config.yaml",
        "lock_file": ".retrain.lock",
    }
    assert run_dir.checkpoint_dir(40) == tmp_path / "checkpoints" / "step_40"
    state = json.loads((save(run_dir, 3) / "trainer_state.json").read_text())
    assert state == {"completed_steps": 3, "step": 2, "checkpoint_path": str(tmp_path / "checkpoints" / "step_3")}


def test_latest_is_the_most_advanced_complete_checkpoint(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path)
    assert run_dir.latest_checkpoint() is None and run_dir.checkpoints() == []
    for completed in (2, 10, 4):
        save(run_dir, completed)
    # a dir without trainer_state.json (copied by hand, half-way) is never trusted, nor a stray name
    (tmp_path / "checkpoints" / "step_99").mkdir()
    (tmp_path / "checkpoints" / "step_latest").mkdir()
    (tmp_path / "checkpoints" / ".step_12.tmp-123").mkdir()  # a save killed before its rename
    assert [c.name for c in run_dir.checkpoints()] == ["step_10", "step_4", "step_2"]
    assert [p.name for p in run_dir.step_dirs()] == ["step_99", "step_10", "step_4", "step_2"]

    (tmp_path / "final").mkdir()  # an incomplete final/ does not count either
    assert run_dir.latest_checkpoint().path == tmp_path / "checkpoints" / "step_10"

    save(run_dir, 10, final=True)  # final/ wins a tie with the step dir of the same count
    latest = run_dir.latest_checkpoint()
    assert latest is not None and latest.is_final and latest.path == tmp_path / "final"
    assert [c.name for c in run_dir.checkpoints()] == ["final", "step_10", "step_4", "step_2"]

    # the finished run continued with a higher max_steps: its newer step dirs come before the old final/
    save(run_dir, 12)
    assert [c.name for c in run_dir.checkpoints()][:2] == ["step_12", "final"]
    assert run_dir.latest_checkpoint().state()["completed_steps"] == 12


def test_status_round_trip(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path)
    assert run_dir.read_status() == {} and run_dir.read_exit() is None and run_dir.read_job() == {}
    assert not run_dir.has_run()
    status = {"state": "running", "step": 4, "max_steps": 10, "eval": {"eval/before_greedy_accuracy": 0.5}}
    run_dir.write_status(status)
    assert run_dir.read_status() == status and run_dir.has_run()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["status.json"]  # the temp file was renamed away
    run_dir.status_file.write_text('{"state": "runn')  # caught mid-write by a non-atomic writer
    assert run_dir.read_status() == {}


def test_metrics_records_skip_a_line_still_being_written(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path)
    assert run_dir.metrics_records() == []
    run_dir.metrics.write_text(json.dumps({"step": 0}) + "\n" + json.dumps({"step": 1}) + "\n" + '{"step": 2, "lo')
    assert run_dir.metrics_records() == [{"step": 0}, {"step": 1}]


def test_the_run_dir_of_a_checkpoint(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path / "run")
    assert RunDir.of_checkpoint(save(run_dir, 5)) == run_dir
    assert RunDir.of_checkpoint(save(run_dir, 5, final=True)) == run_dir
    assert RunDir.of_checkpoint(run_dir.checkpoint_dir(5)).metrics == tmp_path / "run" / "metrics.jsonl"
