"""The run dir's layout is the contract with users, `retrain status` and restarts: names, choice, round trips."""

from __future__ import annotations

import errno
import json
import math
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from retrain.backend.local import OPTIMIZER_FILE as OPTIMIZER_STATE
from retrain.backend.local import LocalBackend
from retrain.errors import CheckpointError
from retrain.housekeeping.rundir import CHECKSUMS_FILE, STATE_FILE, Checkpoint, RunDir
from retrain.housekeeping.trainer_state import TrainerState
from retrain.model.peft_files import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from retrain.training.metrics_log import JsonlLog

LOCAL = LocalBackend.checkpoint_files


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
    """What a backend writes: a PEFT adapter (config + safetensors + model card) and a torch optimizer state."""
    (directory / ADAPTER_CONFIG).write_text(json.dumps({"r": 2}))
    (directory / "README.md").write_text("a model card")
    save_file({"lora_A": torch.ones(2, 8), "lora_B": torch.ones(8, 2)}, directory / ADAPTER_WEIGHTS)
    torch.save({"state": {0: {"exp_avg": torch.ones(16)}}, "param_groups": []}, directory / OPTIMIZER_STATE)


def save_restorable(run_dir: RunDir, completed: int, final: bool = False) -> Checkpoint:
    state = dict.fromkeys(TrainerState.field_names(), 0) | {"completed_steps": completed, "step": completed - 1}
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
        (lambda c: (c.path / OPTIMIZER_STATE).unlink(), f"{OPTIMIZER_STATE} is missing"),
        (lambda c: zero_half_of_the_tensors(c.path / ADAPTER_WEIGHTS), f"{ADAPTER_WEIGHTS} does not match its sha256"),
        (lambda c: (c.path / "README.md").unlink(), "README.md is missing (listed in checksums.json)"),
        (lambda c: (c.path / "README.md").write_text("edited"), "README.md does not match its sha256"),
    ],
)
def test_a_checkpoint_is_damaged_when_any_file_does_not_read_whole(tmp_path: Path, damage, named: str) -> None:
    checkpoint = save_restorable(RunDir(tmp_path), 3)
    assert checkpoint.damage(LOCAL) is None
    damage(checkpoint)
    assert checkpoint.damage(LOCAL).startswith(named)


def zero_half_of_the_tensors(file: Path) -> None:
    """Damage that every reader accepts: the header intact, half the tensor bytes zeroed (a disk fault, a bad copy)."""
    data = bytearray(file.read_bytes())
    start = 8 + int.from_bytes(data[:8], "little")  # safetensors: u64 header length, JSON header, then the tensors
    middle = start + (len(data) - start) // 2
    data[middle:] = bytes(len(data) - middle)
    file.write_bytes(bytes(data))


def test_every_file_of_a_checkpoint_is_recorded_with_its_sha256_last(tmp_path: Path) -> None:
    checkpoint = save_restorable(RunDir(tmp_path), 3)
    recorded = json.loads((checkpoint.path / CHECKSUMS_FILE).read_text())
    assert sorted(recorded) == sorted(["README.md", ADAPTER_CONFIG, ADAPTER_WEIGHTS, OPTIMIZER_STATE, STATE_FILE])
    assert all(len(digest) == 64 for digest in recorded.values())


def test_a_checkpoint_written_before_checksums_stays_valid_and_its_files_are_still_read(tmp_path: Path) -> None:
    checkpoint = save_restorable(RunDir(tmp_path), 3)
    (checkpoint.path / CHECKSUMS_FILE).unlink()
    assert checkpoint.damage(LOCAL) is None
    truncate(checkpoint.path / ADAPTER_WEIGHTS)
    assert checkpoint.damage(LOCAL).startswith(f"{ADAPTER_WEIGHTS} does not read")


def test_damaged_checkpoints_are_set_aside_and_never_listed_again(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path)
    for completed in (2, 4):
        save_restorable(run_dir, completed)
    final = save_restorable(run_dir, 6, final=True)
    truncate(final.state_file)  # its step count no longer reads: it is tried first
    truncate(run_dir.checkpoint_dir(4) / ADAPTER_WEIGHTS)
    assert [c.name for c in run_dir.checkpoints()] == ["final", "step_4", "step_2"]

    found = run_dir.resumable_checkpoint(set_aside=True, required=LOCAL)
    assert found is not None and found.path == run_dir.checkpoint_dir(2)
    assert [c.name for c in run_dir.checkpoints()] == ["step_2"]
    assert [p.name for p in run_dir.step_dirs()] == ["step_2"]
    assert len(list(tmp_path.glob("final.damaged-*"))) == len(list(tmp_path.glob("checkpoints/step_4.damaged-*"))) == 1


def test_with_no_checkpoint_that_reads_nothing_is_renamed_and_the_error_names_each(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path)
    assert run_dir.resumable_checkpoint(set_aside=True, required=LOCAL) is None  # no checkpoint at all: a fresh start
    for completed in (1, 2):
        truncate(save_restorable(run_dir, completed).path / "optimizer.pt")
    with pytest.raises(CheckpointError, match=r"step_2: optimizer.pt does not read .*step_1: optimizer.pt"):
        run_dir.resumable_checkpoint(set_aside=True, required=LOCAL)
    assert [p.name for p in run_dir.step_dirs()] == ["step_2", "step_1"]


def test_replacing_a_checkpoint_killed_half_way_leaves_the_old_one_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kill after the old final/ was renamed aside and before the new one took its name: the restart puts the
    old one back (deleting the old one first, as before, lost final/ and the run started over)."""
    run_dir = RunDir(tmp_path)
    save_restorable(run_dir, 10, final=True)
    rename = os.replace

    def killed_before_the_new_one_is_in_place(source: object, target: object) -> None:
        if Path(str(target)) == run_dir.final_dir:
            raise KeyboardInterrupt("killed")
        rename(source, target)

    monkeypatch.setattr(os, "replace", killed_before_the_new_one_is_in_place)
    with pytest.raises(KeyboardInterrupt):
        save_restorable(run_dir, 20, final=True)
    monkeypatch.undo()
    assert not run_dir.final_dir.exists()

    found = run_dir.resumable_checkpoint(set_aside=True, required=LOCAL)
    assert found is not None and found.is_final and found.state()["completed_steps"] == 10
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]  # the new one's temp dir is removed too


def test_a_restart_removes_what_killed_saves_left_and_nothing_else(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path)
    save_restorable(run_dir, 2)
    save_restorable(run_dir, 4)
    save_restorable(run_dir, 4, final=True)
    left = [
        run_dir.checkpoints_dir / ".step_6.tmp-123",  # killed while writing
        run_dir.checkpoints_dir / ".step_4.replaced-123",  # killed after the new step_4 took its name
        run_dir.checkpoints_dir / ".step_1.pruned-123",  # killed while deleting an old one
        tmp_path / ".final.tmp-77",
    ]
    for hidden in left:
        hidden.mkdir()
        (hidden / ADAPTER_WEIGHTS).write_bytes(b"half")
    kept = [run_dir.checkpoints_dir / "step_3.damaged-20250101T000000", tmp_path / ".hidden-by-the-user"]
    for other in kept:
        other.mkdir()
    run_dir.tidy_interrupted_saves()
    assert not any(hidden.exists() for hidden in left)
    assert all(other.is_dir() for other in kept)
    assert [c.name for c in run_dir.checkpoints()] == ["final", "step_4", "step_2"]


def test_pruning_keeps_the_newest_step_checkpoints_and_final(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path)
    for completed in (1, 2, 3, 4):
        save(run_dir, completed)
    save(run_dir, 2, final=True)
    (run_dir.checkpoints_dir / "step_0").mkdir()  # not a checkpoint retrain wrote: left alone
    run_dir.prune_checkpoints(0)
    assert [c.name for c in run_dir.checkpoints()] == ["step_4", "step_3", "final", "step_2", "step_1"]
    run_dir.prune_checkpoints(2)
    assert [c.name for c in run_dir.checkpoints()] == ["step_4", "step_3", "final"]
    assert sorted(p.name for p in run_dir.checkpoints_dir.iterdir()) == ["step_0", "step_3", "step_4"]


def test_a_failure_before_the_trainer_starts_is_recorded_in_the_status(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path)
    run_dir.write_status({"state": "running", "step": 7, "max_steps": 10, "pid": 1})
    run_dir.record_failure("CheckpointError: no checkpoint can be restored")
    status = run_dir.read_status()
    assert status["state"] == "failed" and status["error"] == "CheckpointError: no checkpoint can be restored"
    assert status["step"] == 7 and status["max_steps"] == 10 and status["pid"] == os.getpid()


def strict_json(line: str) -> dict:
    def refuse(constant: str) -> None:
        raise ValueError(f"bare {constant}")

    return json.loads(line, parse_constant=refuse)


def test_metrics_are_strict_json_with_non_finite_numbers_as_null_and_named(tmp_path: Path) -> None:
    log = JsonlLog(tmp_path / "metrics.jsonl")
    log.append({"step": 0, "loss": math.nan, "grad_norm": torch.tensor(math.inf), "eval": {"x": -math.inf}, "ok": 1.5})
    log.append({"step": 1, "loss": 0.5})
    first, second = (strict_json(line) for line in log.path.read_text().splitlines())
    assert first == {
        "step": 0,
        "loss": None,
        "grad_norm": None,
        "eval": {"x": None},
        "ok": 1.5,
        "nonfinite_keys": ["loss", "grad_norm", "eval.x"],
    }
    assert second == {"step": 1, "loss": 0.5}
    log.restore_from(log.path, last_step=0)  # a rewind keeps the flag
    assert log.records() == [first]


def test_a_torn_last_line_is_dropped_on_read_and_on_restore(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    log = JsonlLog(tmp_path / "metrics.jsonl")
    for step in range(3):
        log.append({"step": step})
    with open(log.path, "ab") as handle:
        handle.write('{"step": 3, "completion": "\u00e9'.encode()[:-1])  # cut mid-record (and mid-character)
    with caplog.at_level("WARNING"):
        assert log.records() == [{"step": 0}, {"step": 1}, {"step": 2}]
    assert "torn last line" in caplog.text and str(log.path) in caplog.text
    log.restore_from(log.path, last_step=1)
    assert log.path.read_text() == '{"step": 0}\n{"step": 1}\n'


def test_a_damaged_line_before_the_last_names_the_file_and_line(tmp_path: Path) -> None:
    log = JsonlLog(tmp_path / "metrics.jsonl")
    log.path.write_text('{"step": 0}\n{"step": 1, "lo\n{"step": 2}\n')
    with pytest.raises(CheckpointError, match=f"{log.path} line 2 is not a JSON record"):
        log.records()


def test_an_append_the_disk_cuts_short_leaves_no_partial_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = JsonlLog(tmp_path / "metrics.jsonl")
    log.append({"step": 0})
    before = log.path.read_bytes()
    write = os.write

    def disk_full_half_way(fd: int, data: bytes) -> int:
        return write(fd, data[: len(data) // 2])  # what write(2) does when the disk fills mid-way

    monkeypatch.setattr(os, "write", disk_full_half_way)
    with pytest.raises(OSError) as raised:
        log.append({"step": 1, "loss": 0.25})
    monkeypatch.undo()
    assert raised.value.errno == errno.ENOSPC
    assert log.path.read_bytes() == before
    log.append({"step": 1})
    assert log.records() == [{"step": 0}, {"step": 1}]
