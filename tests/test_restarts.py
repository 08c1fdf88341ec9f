"""A restart never writes a step twice nor loses one, whatever point a kill stopped the run at (real trainer,
tiny model, real files): before the first checkpoint, mid-write of a log line, while a checkpoint was replaced,
in a run seeded by `resume.from`, and past checkpoints damaged in place."""

from __future__ import annotations

import json
import shutil
from contextlib import ExitStack
from pathlib import Path

import pytest

from retrain.backend.local import LocalBackend
from retrain.config import compose
from retrain.errors import CheckpointError, ConfigError
from retrain.housekeeping.rundir import CHECKSUMS_FILE, STATE_FILE, RunDir
from retrain.housekeeping.trainer_state import TrainerState
from retrain.model.peft_files import ADAPTER_WEIGHTS
from retrain.run import build_trainer
from tests.conftest import QUICK, SMALL_BATCH, read_metrics, without_timing
from tests.test_rundir import truncate, zero_half_of_the_tensors

QUICK_SAVING = [*QUICK, *SMALL_BATCH, "training.save_every=1"]
STEPS = 2
LOGS = ["metrics.jsonl", "emergence/steps.jsonl", "emergence/generations.jsonl"]


def train(run_dir: Path, *overrides: str) -> dict:
    """Build every part as `python -m retrain` does and run to STEPS; returns the final status."""
    with ExitStack() as parts:
        return build_trainer(compose([*QUICK_SAVING, f"training.max_steps={STEPS}", *overrides]), run_dir, parts).run()


def steps_logged(run_dir: Path) -> dict[str, list[int]]:
    return {name: [json.loads(line)["step"] for line in (run_dir / name).read_text().splitlines()] for name in LOGS}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted run that checkpointed after every step."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    train(run_dir)
    return run_dir


def killed(reference: Path, to: Path, *, checkpoints: int) -> Path:
    """The reference run as a kill left it when only its first `checkpoints` step checkpoints were written."""
    shutil.copytree(reference, to)
    shutil.rmtree(to / "final")
    for step in range(checkpoints + 1, STEPS + 1):
        shutil.rmtree(to / "checkpoints" / f"step_{step}")
    return to


def test_a_run_killed_before_its_first_checkpoint_starts_over_without_writing_a_step_twice(
    reference: Path, tmp_path: Path
) -> None:
    """Killed while writing its first checkpoint: the logs hold step 0 and a temp dir is left behind."""
    run_dir = killed(reference, tmp_path / "run", checkpoints=0)
    for name in LOGS:
        first_step = [line for line in (run_dir / name).read_text().splitlines() if json.loads(line)["step"] == 0]
        (run_dir / name).write_text("\n".join(first_step) + "\n")
    left_behind = run_dir / "checkpoints" / ".step_1.tmp-4242"
    left_behind.mkdir()
    (left_behind / ADAPTER_WEIGHTS).write_bytes(b"half")

    assert train(run_dir)["state"] == "done"
    assert steps_logged(run_dir) == steps_logged(reference)
    assert without_timing(read_metrics(run_dir)) == without_timing(read_metrics(reference))
    assert not left_behind.exists()


def test_a_torn_last_line_is_dropped_and_the_run_resumes_exactly(reference: Path, tmp_path: Path) -> None:
    """Killed (or out of disk) while appending the last step's records, after its checkpoint was written."""
    run_dir = killed(reference, tmp_path / "run", checkpoints=STEPS - 1)
    for name in LOGS:
        text = (run_dir / name).read_text()
        (run_dir / name).write_text(text[: len(text) - 20])  # the last record cut short, no newline after it

    assert train(run_dir)["state"] == "done"
    assert without_timing(read_metrics(run_dir)) == without_timing(read_metrics(reference))
    assert steps_logged(run_dir) == steps_logged(reference)


def test_resume_from_only_seeds_a_new_run(reference: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    source = killed(reference, tmp_path / "source", checkpoints=1)
    run_dir = tmp_path / "seeded"
    seeded = f"resume.from={source}"
    assert train(run_dir, seeded)["state"] == "done"
    assert without_timing(read_metrics(run_dir)) == without_timing(read_metrics(reference))
    final = (run_dir / "final").stat().st_ino

    # the same command again (a requeued job): the run dir's own final/ wins, nothing is retrained or rewritten
    with caplog.at_level("INFO", logger="retrain"):
        assert train(run_dir, seeded)["state"] == "done"
    assert f"Run at {run_dir / 'final'} already finished" in caplog.text
    assert (run_dir / "final").stat().st_ino == final
    assert without_timing(read_metrics(run_dir)) == without_timing(read_metrics(reference))

    # killed before its final/: it continues from its own newest checkpoint, not from the source's
    shutil.rmtree(run_dir / "final")
    caplog.clear()
    with caplog.at_level("INFO", logger="retrain"):
        assert train(run_dir, seeded)["state"] == "done"
    assert f"Resumed from {run_dir / 'checkpoints' / f'step_{STEPS}'}" in caplog.text
    assert without_timing(read_metrics(run_dir)) == without_timing(read_metrics(reference))
    assert not (source / "final").exists()  # the source is only read


def test_with_none_of_its_own_checkpoints_readable_resume_from_is_the_way_out(
    reference: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run_dir = killed(reference, tmp_path / "run", checkpoints=1)
    truncate(run_dir / "checkpoints" / "step_1" / STATE_FILE)
    with ExitStack() as parts, caplog.at_level("WARNING", logger="retrain"):
        trainer = build_trainer(compose([*QUICK_SAVING, f"resume.from={reference}"]), run_dir, parts)
    assert trainer.resume_checkpoint == reference / "final"
    assert "no checkpoint in" in caplog.text and f"resume.from={reference}" in caplog.text


def test_a_restart_that_cannot_restore_records_the_failure_in_the_status(reference: Path, tmp_path: Path) -> None:
    run_dir = killed(reference, tmp_path / "run", checkpoints=STEPS)
    RunDir(run_dir).write_status({**RunDir(run_dir).read_status(), "state": "running", "step": 1})
    for step in range(1, STEPS + 1):
        truncate(run_dir / "checkpoints" / f"step_{step}" / STATE_FILE)
    with ExitStack() as parts, pytest.raises(CheckpointError):
        build_trainer(compose([*QUICK_SAVING, f"training.max_steps={STEPS}"]), run_dir, parts)
    status = RunDir(run_dir).read_status()
    assert status["state"] == "failed" and status["error"].startswith("CheckpointError: no checkpoint in")
    assert status["step"] == 1

    # a checkpoint that reads whole but does not fit this model fails in the trainer: recorded as well
    other = tmp_path / "other"
    with pytest.raises(ConfigError, match="does not match model.lora_rank"):
        train(other, f"resume.from={reference / 'checkpoints' / 'step_1'}", "model.lora_rank=4")
    status = RunDir(other).read_status()
    assert status["state"] == "failed" and "does not match model.lora_rank" in status["error"]
    # ... or adapts other modules
    with pytest.raises(ConfigError, match=r"was trained on model.target_modules=\[.*\], this run adapts \['q_proj'\]"):
        train(
            tmp_path / "fewer", f"resume.from={reference / 'checkpoints' / 'step_1'}", "model.target_modules=[q_proj]"
        )


def test_an_older_checkpoint_that_does_not_read_never_blocks_the_newer_one(
    reference: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """final/ of a run finished at 1 step, then continued to 2 (its step_2 is newer): final/'s state truncated.
    The run also was killed after its last step checkpoint: it still writes final/."""
    run_dir = killed(reference, tmp_path / "run", checkpoints=STEPS)
    shutil.copytree(reference / "checkpoints" / f"step_{STEPS - 1}", run_dir / "final")
    truncate(run_dir / "final" / STATE_FILE)

    with caplog.at_level("WARNING", logger="retrain"):
        assert train(run_dir)["state"] == "done"
    assert f"checkpoint {run_dir / 'final'} is damaged ({STATE_FILE} does not read" in caplog.text
    assert RunDir(run_dir).latest_checkpoint().path == run_dir / "final"
    assert RunDir(run_dir).latest_checkpoint().state()["completed_steps"] == STEPS
    assert without_timing(read_metrics(run_dir)) == without_timing(read_metrics(reference))


def test_a_checkpoint_whose_weights_were_zeroed_in_place_is_not_trusted(
    reference: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run_dir = killed(reference, tmp_path / "run", checkpoints=STEPS)
    newest = run_dir / "checkpoints" / f"step_{STEPS}"
    recorded = json.loads((newest / CHECKSUMS_FILE).read_text())
    assert {ADAPTER_WEIGHTS, "adapter_config.json", "optimizer.pt", STATE_FILE} <= recorded.keys()
    zero_half_of_the_tensors(newest / ADAPTER_WEIGHTS)

    with caplog.at_level("WARNING", logger="retrain"):
        assert train(run_dir)["state"] == "done"
    assert f"{ADAPTER_WEIGHTS} does not match its sha256" in caplog.text
    assert f"resuming from {run_dir / 'checkpoints' / f'step_{STEPS - 1}'}" in caplog.text
    assert without_timing(read_metrics(run_dir)) == without_timing(read_metrics(reference))


def test_keep_checkpoints_keeps_the_newest_step_checkpoints_and_final(reference: Path, tmp_path: Path) -> None:
    run_dir = killed(reference, tmp_path / "run", checkpoints=STEPS - 1)
    assert train(run_dir, "training.keep_checkpoints=1")["state"] == "done"  # the same run: not part of its identity
    assert [c.name for c in RunDir(run_dir).checkpoints()] == ["final", f"step_{STEPS}"]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [f"step_{STEPS}"]
    with ExitStack() as parts, pytest.raises(ConfigError, match="training.keep_checkpoints must be >= 0"):
        build_trainer(compose([*QUICK_SAVING, "training.keep_checkpoints=-1"]), tmp_path / "refused", parts)


def test_a_checkpoint_holds_the_backend_files_it_declares_and_one_trainer_state(reference: Path) -> None:
    """What Trainer.save writes is TrainerState, field for field, and what _restore reads back; the backend's
    own files are those it declares (Backend.checkpoint_files), so the run dir spells no backend's file names."""
    checkpoint = reference / "final"
    saved = json.loads((checkpoint / STATE_FILE).read_text())
    assert saved.keys() == {*TrainerState.field_names(), "checkpoint_path"}
    assert TrainerState.from_json(saved).to_json() == {k: v for k, v in saved.items() if k != "checkpoint_path"}
    assert set(LocalBackend.checkpoint_files) <= {p.name for p in checkpoint.iterdir()}
    del saved["rng"]
    with pytest.raises(ValueError, match="trainer state lacks rng"):
        TrainerState.from_json(saved)
