"""Split-mode runs that sample ahead (`training.max_staleness` k, docs/async.md), end to end on two CPU "devices"
(a server engine's: tests/inference/test_server_training.py). The lags follow the schedule, and a run stopped
gracefully between checkpoints keeps every batch sampled ahead, so the resumed run trains on exactly the batches of
the uninterrupted one."""

from __future__ import annotations

import logging
from contextlib import ExitStack
from pathlib import Path

import pytest

from retrain.backend.local import LocalBackend
from retrain.config import compose
from retrain.housekeeping.rundir import Checkpoint
from retrain.run import build_trainer
from retrain.training.sampled_ahead import SAMPLED_AHEAD_FILE, load_sampled_ahead
from tests.conftest import QUICK, SMALL_BATCH, read_metrics, without_timing
from tests.test_split_mode import stopped_after

STEPS, EVERY, STOP_AFTER = 10, 5, 7  # checkpoints before steps 0 and 5; a stop after step 6, off the boundary
SPLIT = [
    *QUICK,
    *SMALL_BATCH,
    "backend.devices='cpu,cpu'",
    f"training.save_every={EVERY}",
    f"training.max_steps={STEPS}",
]


def split_trained(run_dir: Path, k: int, stop_after: int | None = None, *extra: str) -> dict:
    with ExitStack() as parts:
        trainer = build_trainer(compose([*SPLIT, f"training.max_staleness={k}", *extra]), run_dir, parts)
        return (stopped_after(trainer, stop_after) if stop_after else trainer).run()


def kept_batches(run_dir: Path, k: int) -> list[int]:
    """The steps of the batches the stop's checkpoint kept (it reads with torch's weights-only loader)."""
    checkpoint = run_dir / "checkpoints" / f"step_{STOP_AFTER}"
    assert Checkpoint(checkpoint).damage(LocalBackend.checkpoint_files) is None
    assert (checkpoint / SAMPLED_AHEAD_FILE).is_file()
    return [batch.step for batch in load_sampled_ahead(checkpoint, k)]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("k", "lags", "kept"),
    [
        (1, [0, 1, 1, 1, 1, 0, 1, 1, 1, 1], [7]),
        (2, [0, 1, 2, 2, 2, 0, 1, 2, 2, 2], [7, 8]),
        (4, [0, 1, 2, 3, 4, 0, 1, 2, 3, 4], [7, 8, 9]),
    ],
)
def test_a_split_run_stopped_off_a_checkpoint_resumes_on_the_batches_sampled_ahead(
    tmp_path: Path, k: int, lags: list[int], kept: list[int]
) -> None:
    """The stop after step 6 keeps the batches pinned to step 6's weights or older (steps 7.. up to k ahead; the
    last batch is step 9), and the resumed run trains on them: every metric but the timings is the uninterrupted
    run's."""
    assert split_trained(tmp_path / "full", k)["state"] == "done"
    assert split_trained(tmp_path / "stopped", k, STOP_AFTER)["state"] == "stopped"
    assert kept_batches(tmp_path / "stopped", k) == kept
    assert split_trained(tmp_path / "stopped", k)["state"] == "done"
    full, resumed = read_metrics(tmp_path / "full"), read_metrics(tmp_path / "stopped")
    assert [r["engine/policy_lag"] for r in full] == lags
    assert all(r["async/trainer_wait_s"] >= 0 and r["async/producer_wait_s"] >= 0 for r in full)
    assert all("mismatch/ratio_mean" in r for r in full if r["num_datums"])  # tis, the default when sampling ahead
    assert without_timing(resumed) == without_timing(full)


@pytest.mark.slow
def test_batches_sampled_ahead_under_another_bound_are_sampled_again(tmp_path: Path, caplog) -> None:
    """A checkpoint of k = 2 resumed (resume.from) with k = 1: its two batches ahead would break the new bound, so
    they are dropped and sampled again on the new schedule, from the data state before them."""
    assert split_trained(tmp_path / "stopped", 2, STOP_AFTER)["state"] == "stopped"
    checkpoint = tmp_path / "stopped" / "checkpoints" / f"step_{STOP_AFTER}"
    with caplog.at_level(logging.WARNING):
        assert split_trained(tmp_path / "resumed", 1, None, f"resume.from={checkpoint}")["state"] == "done"
    assert "this run's bound is 1: they are sampled again" in caplog.text
    resumed = read_metrics(tmp_path / "resumed")
    assert [r["step"] for r in resumed] == list(range(STEPS))
    assert [r["engine/policy_lag"] for r in resumed[STOP_AFTER:]] == [0, 1, 1]  # resumed: lag 0, then k = 1
