"""The run dir's layout is the contract with users, `retrain status` and restarts: names, choice, round trips."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from retrain.errors import CheckpointError
from retrain.rundir import ADAPTER_CONFIG, ADAPTER_WEIGHTS, RESTORE_KEYS, STATE_FILE, Checkpoint, RunDir


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


def write_model_files(directory: Path) -> None:
    """What a backend writes: a PEFT adapter (config + safetensors) and a torch optimizer state."""
    (directory / ADAPTER_CONFIG).write_text(json.dumps({"r": 2}))
    save_file({"lora_A": torch.ones(2, 8), "lora_B": torch.zeros(8, 2)}, directory / ADAPTER_WEIGHTS)
    torch.save({"state": {0: {"exp_avg": torch.ones(16)}}, "param_groups": []}, directory / "optimizer.pt")


def save_restorable(run_dir: RunDir, completed: int, final: bool = False) -> Checkpoint:
    state = dict.fromkeys(RESTORE_KEYS, 0) | {"completed_steps": completed, "step": completed - 1}
    return run_dir.save_checkpoint(completed, write_model_files, state, final=final)


def truncate(file: Path) -> None:
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


@pytest.mark.parametrize(
    ("damage", "named"),
    [
        (lambda c: truncate(c.path / STATE_FILE), f"{STATE_FILE} does not read (JSONDecodeError"),
        (lambda c: c.state_file.write_text("[1, 2]"), f"{STATE_FILE} holds a list"),
        (lambda c: c.state_file.write_text('{"completed_steps": 3, "step": 2}'), f"{STATE_FILE} lacks algorithm"),
        (lambda c: (c.path / ADAPTER_CONFIG).unlink(), f"{ADAPTER_CONFIG} is missing"),
        (lambda c: truncate(c.path / ADAPTER_CONFIG), f"{ADAPTER_CONFIG} does not read"),
        (lambda c: truncate(c.path / ADAPTER_WEIGHTS), f"{ADAPTER_WEIGHTS} does not read (SafetensorError"),
        (lambda c: (c.path / ADAPTER_WEIGHTS).write_bytes(b"\x00" * 64), f"{ADAPTER_WEIGHTS} does not read"),
        (lambda c: truncate(c.path / "optimizer.pt"), "optimizer.pt does not read"),
    ],
)
def test_a_checkpoint_is_damaged_when_any_file_does_not_read_whole(tmp_path: Path, damage, named: str) -> None:
    checkpoint = save_restorable(RunDir(tmp_path), 3)
    assert checkpoint.damage() is None
    damage(checkpoint)
    assert checkpoint.damage().startswith(named)


def test_damaged_checkpoints_are_set_aside_and_never_listed_again(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path)
    for completed in (2, 4):
        save_restorable(run_dir, completed)
    final = save_restorable(run_dir, 6, final=True)
    truncate(final.state_file)  # its step count no longer reads: it is tried first
    truncate(run_dir.checkpoint_dir(4) / ADAPTER_WEIGHTS)
    assert [c.name for c in run_dir.checkpoints()] == ["final", "step_4", "step_2"]

    found = run_dir.resumable_checkpoint(set_aside=True)
    assert found is not None and found.path == run_dir.checkpoint_dir(2)
    assert [c.name for c in run_dir.checkpoints()] == ["step_2"]
    assert [p.name for p in run_dir.step_dirs()] == ["step_2"]
    assert len(list(tmp_path.glob("final.damaged-*"))) == len(list(tmp_path.glob("checkpoints/step_4.damaged-*"))) == 1


def test_with_no_checkpoint_that_reads_nothing_is_renamed_and_the_error_names_each(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path)
    assert run_dir.resumable_checkpoint(set_aside=True) is None  # no checkpoint at all: a fresh start
    for completed in (1, 2):
        truncate(save_restorable(run_dir, completed).path / "optimizer.pt")
    with pytest.raises(CheckpointError, match=r"step_2: optimizer.pt does not read .*step_1: optimizer.pt"):
        run_dir.resumable_checkpoint(set_aside=True)
    assert [p.name for p in run_dir.step_dirs()] == ["step_2", "step_1"]
