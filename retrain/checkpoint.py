"""The checkpoint API that trainer.py and run.py import today, now served by `retrain.rundir`.

Transitional: delete this module once those two use `RunDir` and `Checkpoint` directly.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from retrain.rundir import CHECKPOINTS, FINAL, STATE_FILE, Checkpoint, RunDir, write_json_atomic

__all__ = ["CHECKPOINTS", "FINAL", "STATE_FILE", "latest_checkpoint", "read_state", "save_checkpoint",
           "write_json_atomic"]


def save_checkpoint(target: Path, write_payload: Callable[[Path], None], state: dict[str, Any]) -> Path:
    return Checkpoint.write(target, write_payload, state).path


def read_state(checkpoint: Path) -> dict[str, Any]:
    return Checkpoint(checkpoint).state()


def latest_checkpoint(run_dir: Path) -> Path | None:
    latest = RunDir(run_dir).latest_checkpoint()
    return None if latest is None else latest.path
