"""Checkpoints are atomic: a save that dies half-way leaves the previous checkpoint as the latest."""

from __future__ import annotations

from pathlib import Path

import pytest

from retrain.housekeeping.rundir import RunDir


def write_adapter(directory: Path) -> None:
    (directory / "adapter_model.safetensors").write_bytes(b"weights")


def test_a_save_that_crashes_leaves_no_checkpoint_behind(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path)
    run_dir.save_checkpoint(1, write_adapter, {"completed_steps": 1, "step": 0})

    def crash_half_way(directory: Path) -> None:
        write_adapter(directory)
        raise KeyboardInterrupt("killed while writing")

    with pytest.raises(KeyboardInterrupt):
        run_dir.save_checkpoint(2, crash_half_way, {"completed_steps": 2, "step": 1})
    assert not (tmp_path / "checkpoints" / "step_2").exists()
    latest = run_dir.latest_checkpoint()
    assert latest is not None and latest.path == tmp_path / "checkpoints" / "step_1"
    assert latest.state()["completed_steps"] == 1


def test_saving_again_replaces_the_checkpoint_whole(tmp_path: Path) -> None:
    """A continued run rewrites final/: the new one replaces the old, no file of the old one survives."""
    run_dir = RunDir(tmp_path)

    def write_old(directory: Path) -> None:
        write_adapter(directory)
        (directory / "only_in_the_old_one").write_text("stale")

    run_dir.save_checkpoint(10, write_old, {"completed_steps": 10, "step": 9}, final=True)
    saved = run_dir.save_checkpoint(20, write_adapter, {"completed_steps": 20, "step": 19}, final=True)
    assert saved.path == tmp_path / "final" and saved.state()["completed_steps"] == 20
    assert sorted(p.name for p in saved.path.iterdir()) == [
        "adapter_model.safetensors",
        "checksums.json",
        "trainer_state.json",
    ]
    assert [p.name for p in tmp_path.iterdir()] == ["final"]  # no temp dir left behind
