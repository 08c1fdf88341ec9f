"""Checkpoints are atomic: a save that dies half-way leaves the previous checkpoint as the latest."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from retrain.checkpoint import latest_checkpoint, read_state, save_checkpoint


def write_adapter(directory: Path) -> None:
    (directory / "adapter_model.safetensors").write_bytes(b"weights")


def test_a_save_that_crashes_leaves_no_checkpoint_behind(tmp_path: Path) -> None:
    save_checkpoint(tmp_path / "checkpoints" / "step_1", write_adapter, {"completed_steps": 1, "step": 0})

    def crash_half_way(directory: Path) -> None:
        write_adapter(directory)
        raise KeyboardInterrupt("killed while writing")

    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path / "checkpoints" / "step_2", crash_half_way, {"completed_steps": 2, "step": 1})
    assert not (tmp_path / "checkpoints" / "step_2").exists()
    latest = latest_checkpoint(tmp_path)
    assert latest == tmp_path / "checkpoints" / "step_1"
    assert read_state(latest)["completed_steps"] == 1


def test_latest_prefers_the_most_advanced_complete_checkpoint(tmp_path: Path) -> None:
    for completed in (2, 10, 4):
        save_checkpoint(tmp_path / "checkpoints" / f"step_{completed}", write_adapter,
                        {"completed_steps": completed, "step": completed - 1})
    # a directory without trainer_state.json (e.g. copied by hand, half-way) is never trusted
    (tmp_path / "checkpoints" / "step_99").mkdir()
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step_10"
    save_checkpoint(tmp_path / "final", write_adapter, {"completed_steps": 10, "step": 9})
    assert latest_checkpoint(tmp_path) == tmp_path / "final"
    state = json.loads((tmp_path / "final" / "trainer_state.json").read_text())
    assert state["checkpoint_path"] == str(tmp_path / "final")
