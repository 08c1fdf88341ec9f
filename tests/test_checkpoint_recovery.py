"""A damaged or unwritable checkpoint never ends a run it could continue (real trainer, tiny model, real files).

A restart reads the newest checkpoint whole and falls back to the newest one that reads, continuing
the exact trajectory; a full disk while checkpointing ends the run with one message naming the
checkpoint a rerun resumes from, and leaves no temp dir behind.
"""

from __future__ import annotations

import errno
import json
import shutil
import subprocess
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
import torch

from retrain.backend.local import LocalBackend
from retrain.config import compose
from retrain.errors import CheckpointError
from retrain.housekeeping.rundir import STATE_FILE, RunDir
from retrain.model.peft_files import ADAPTER_WEIGHTS
from retrain.run import build_trainer
from tests.conftest import QUICK, SMALL_BATCH, read_metrics, run_cli, without_timing

QUICK_SAVING = [*QUICK, *SMALL_BATCH, "training.save_every=1"]
STEPS = 2


def train(run_dir: Path, *overrides: str) -> dict:
    """Build every part as `python -m retrain` does and run to STEPS; returns the final status."""
    with ExitStack() as parts:
        return build_trainer(compose([*QUICK_SAVING, f"training.max_steps={STEPS}", *overrides]), run_dir, parts).run()


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted run that checkpointed after every step."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    train(run_dir)
    return run_dir


@pytest.fixture
def killed_after_last_step(reference: Path, tmp_path: Path) -> Path:
    """The reference run as a kill after its last step checkpoint left it: no final/ yet."""
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    shutil.rmtree(run_dir / "final")
    return run_dir


def truncate(file: Path) -> None:
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


@pytest.mark.parametrize("damaged_file", [STATE_FILE, ADAPTER_WEIGHTS, "optimizer.pt"])
def test_a_damaged_newest_checkpoint_is_set_aside_and_the_run_continues_exactly(
    damaged_file: str, killed_after_last_step: Path, reference: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run_dir = killed_after_last_step
    newest = run_dir / "checkpoints" / f"step_{STEPS}"
    truncate(newest / damaged_file)

    with caplog.at_level("WARNING", logger="retrain"):
        assert train(run_dir)["state"] == "done"

    set_aside = list((run_dir / "checkpoints").glob(f"step_{STEPS}.damaged-*"))
    assert len(set_aside) == 1 and (set_aside[0] / damaged_file).stat().st_size > 0  # kept as it was, not deleted
    warning = next(r.getMessage() for r in caplog.records if "damaged" in r.getMessage())
    assert str(newest) in warning and damaged_file in warning and set_aside[0].name in warning
    assert str(run_dir / "checkpoints" / f"step_{STEPS - 1}") in warning  # where it resumed
    # step 2 ran again from the step_2 checkpoint and wrote what the uninterrupted run wrote
    assert without_timing(read_metrics(run_dir)) == without_timing(read_metrics(reference))
    assert RunDir(run_dir).latest_checkpoint().path == run_dir / "final"
    assert [c.name for c in RunDir(run_dir).checkpoints()] == ["final", "step_2", "step_1"]


def test_with_every_checkpoint_damaged_the_restart_says_what_is_wrong_with_each(killed_after_last_step: Path) -> None:
    run_dir = killed_after_last_step
    for step in range(1, STEPS + 1):
        truncate(run_dir / "checkpoints" / f"step_{step}" / STATE_FILE)
    with ExitStack() as parts, pytest.raises(CheckpointError) as raised:
        build_trainer(compose([*QUICK_SAVING, f"training.max_steps={STEPS}"]), run_dir, parts)
    message = str(raised.value)
    for step in range(1, STEPS + 1):
        assert f"{run_dir / 'checkpoints' / f'step_{step}'}: {STATE_FILE} does not read (JSONDecodeError" in message
    # nothing is renamed: the user decides what to repair
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_1", "step_2"]


def test_resume_from_a_damaged_checkpoint_dir_is_refused(reference: Path, tmp_path: Path) -> None:
    source = tmp_path / "source"
    shutil.copytree(reference / "checkpoints" / "step_1", source)
    truncate(source / ADAPTER_WEIGHTS)
    with ExitStack() as parts, pytest.raises(CheckpointError, match=f"resume.from=.*{ADAPTER_WEIGHTS} does not read"):
        build_trainer(compose([*QUICK_SAVING, f"resume.from={source}"]), tmp_path / "run", parts)


def test_resume_from_another_run_skips_its_damaged_checkpoints_without_renaming_them(
    killed_after_last_step: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    source = killed_after_last_step
    truncate(source / "checkpoints" / f"step_{STEPS}" / "optimizer.pt")
    with ExitStack() as parts, caplog.at_level("WARNING", logger="retrain"):
        trainer = build_trainer(compose([*QUICK_SAVING, f"resume.from={source}"]), tmp_path / "new", parts)
    assert trainer.resume_checkpoint == source / "checkpoints" / f"step_{STEPS - 1}"
    assert (source / "checkpoints" / f"step_{STEPS}").is_dir()  # another run's dir is left as it is
    assert any("optimizer.pt" in r.getMessage() for r in caplog.records)


@pytest.fixture
def killed_before_last_step(killed_after_last_step: Path) -> Path:
    """The reference run killed while its last step ran: step 1 is the newest checkpoint."""
    shutil.rmtree(killed_after_last_step / "checkpoints" / f"step_{STEPS}")
    return killed_after_last_step


def test_a_save_the_filesystem_refuses_ends_the_run_naming_the_intact_checkpoint(
    killed_before_last_step: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk fills while the optimizer state of the last step's checkpoint is written (injected where torch
    writes the file)."""
    write = torch.save

    def full_disk_at_last_step(obj: object, file: object, *args: object, **kwargs: object) -> None:
        if f"step_{STEPS}.tmp" in str(file):
            raise OSError(errno.ENOSPC, "No space left on device")
        write(obj, file, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_disk_at_last_step)
    with pytest.raises(CheckpointError) as raised:
        train(killed_before_last_step)
    assert_full_disk_handled(killed_before_last_step, str(raised.value))


def assert_full_disk_handled(run_dir: Path, message: str) -> None:
    intact = run_dir / "checkpoints" / f"step_{STEPS - 1}"
    assert f"could not write checkpoint {run_dir / 'checkpoints' / f'step_{STEPS}'}: " in message
    assert "no space left on " in message.lower()
    assert f"{intact} is intact: rerunning the same command resumes from it" in message
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == [intact.name]  # no temp dir left behind
    assert RunDir(run_dir).resumable_checkpoint(set_aside=False, required=LocalBackend.checkpoint_files).path == intact
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "failed" and "CheckpointError" in status["error"] and str(intact) in status["error"]


def test_a_failed_save_leaves_no_temp_dir_and_only_a_filesystem_refusal_becomes_a_message(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path)

    def buggy_backend(directory: Path) -> None:
        (directory / ADAPTER_WEIGHTS).write_bytes(b"half")
        raise TypeError("a bug in the backend")

    def full_disk(directory: Path) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(directory / ADAPTER_WEIGHTS))

    with pytest.raises(TypeError, match="a bug in the backend"):  # a bug keeps its traceback
        run_dir.save_checkpoint(1, buggy_backend, {})
    with pytest.raises(CheckpointError, match="no earlier checkpoint of this run exists: rerunning the same command"):
        run_dir.save_checkpoint(1, full_disk, {})
    assert list(run_dir.checkpoints_dir.iterdir()) == []


@pytest.fixture
def small_filesystem(tmp_path: Path) -> Iterator[Callable[[Path, int], None]]:
    """Mount a tmpfs of a given size at a path (needs root and mount rights; skipped without them)."""
    mounted: list[Path] = []

    def mount(at: Path, size: int) -> None:
        at.mkdir(parents=True, exist_ok=True)
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(at)], capture_output=True)
        if result.returncode != 0:
            pytest.skip(f"cannot mount a small filesystem here: {result.stderr.decode().strip()}")
        mounted.append(at)

    yield mount
    for at in mounted:
        subprocess.run(["umount", str(at)], check=True)


@pytest.mark.slow
def test_a_real_full_disk_while_checkpointing_prints_one_line_and_the_same_command_resumes(
    killed_before_last_step: Path, tmp_path: Path, small_filesystem: Callable[[Path, int], None]
) -> None:
    """checkpoints/ on a filesystem with room for one and a half checkpoints: the next one fills it.
    (The CLI runs with one thread, the in-process reference with torch's default: metrics are compared
    exactly in the tests above, not here.)"""
    run_dir = killed_before_last_step
    kept = tmp_path / "kept"
    (run_dir / "checkpoints").rename(kept)
    checkpoint_size = sum(f.stat().st_size for f in (kept / f"step_{STEPS - 1}").iterdir())
    small_filesystem(run_dir / "checkpoints", int(1.5 * checkpoint_size))
    shutil.copytree(kept / f"step_{STEPS - 1}", run_dir / "checkpoints" / f"step_{STEPS - 1}")
    command = [*QUICK_SAVING, f"training.max_steps={STEPS}", f"hydra.run.dir={run_dir}"]

    result = run_cli(command, cwd=tmp_path, check=False)
    printed = result.stdout + result.stderr
    assert result.returncode == 1 and "Traceback" not in printed
    lines = [line for line in printed.splitlines() if "could not write checkpoint" in line]
    assert len(lines) == 1
    assert_full_disk_handled(run_dir, lines[0])
    assert "Traceback" in (run_dir / "run.log").read_text()

    subprocess.run(["mount", "-o", f"remount,size={4 * checkpoint_size}", str(run_dir / "checkpoints")], check=True)
    rerun = run_cli(command, cwd=tmp_path)
    assert f"Resumed from {run_dir / 'checkpoints' / f'step_{STEPS - 1}'}" in rerun.stdout + rerun.stderr
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(STEPS))
    assert json.loads((run_dir / "status.json").read_text())["state"] == "done"
