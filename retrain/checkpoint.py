"""Atomic checkpoints: a checkpoint directory either exists complete or not at all.

A checkpoint is written into a hidden temporary directory, every file is fsynced, and the
directory is renamed into place; `trainer_state.json` is written last, so a directory that has it
is whole. A killed run therefore never leaves a half-written checkpoint that resume would trust.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

STATE_FILE = "trainer_state.json"
CHECKPOINTS = "checkpoints"
FINAL = "final"


def write_json_atomic(path: Path, payload: Any) -> None:
    """Write JSON through a temp file + fsync + rename, so readers never see a partial file."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as handle:
        json.dump(payload, handle, indent=2, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def _fsync_tree(root: Path) -> None:
    for file in root.rglob("*"):
        if file.is_file():
            with open(file, "rb") as handle:
                os.fsync(handle.fileno())
    dir_fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def save_checkpoint(target: Path, write_payload: Callable[[Path], None], state: dict[str, Any]) -> Path:
    """Create `target` atomically: `write_payload(tmp_dir)` writes the model files, then the state."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    write_payload(tmp)
    state = {**state, "checkpoint_path": str(target)}
    write_json_atomic(tmp / STATE_FILE, state)
    _fsync_tree(tmp)
    if target.exists():
        shutil.rmtree(target)
    os.replace(tmp, target)
    return target


def read_state(checkpoint: Path) -> dict[str, Any]:
    with open(checkpoint / STATE_FILE) as handle:
        return json.load(handle)


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The most advanced complete checkpoint of a run dir (final/ or checkpoints/step_N/), if any."""
    candidates = [p for p in (run_dir / CHECKPOINTS).glob("step_*") if (p / STATE_FILE).is_file()]
    if (run_dir / FINAL / STATE_FILE).is_file():
        candidates.append(run_dir / FINAL)
    if not candidates:
        return None
    return max(candidates, key=lambda p: (read_state(p)["completed_steps"], p.name == FINAL))
