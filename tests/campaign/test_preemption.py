"""The pre-emption guard without a cluster: which signal it takes over, and what it does on each signal.

tests/campaign/test_slurm.py runs the same guard end to end on a real SLURM cluster.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from retrain.campaign.preemption import TERMINATED_EXIT_CODE, preemption_signal, requeue_on_preemption


def test_no_signal_outside_a_submitit_job(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SUBMITIT_EXECUTOR", raising=False)
    assert preemption_signal() is None


def test_the_signal_is_the_one_submitit_requeues_on() -> None:
    """USR2 by default; SUBMITIT_PREEMPT_SIGNAL (read when submitit is imported) changes it."""
    code = "from retrain.campaign.preemption import preemption_signal; print(preemption_signal().name)"
    for setting, expected in ((None, "SIGUSR2"), ("USR1", "SIGUSR1")):
        env = {key: value for key, value in os.environ.items() if key != "SUBMITIT_PREEMPT_SIGNAL"}
        env.update({"SUBMITIT_EXECUTOR": "slurm", **({"SUBMITIT_PREEMPT_SIGNAL": setting} if setting else {})})
        result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert result.stdout.strip() == expected


class Run:
    """What the guard needs of a trainer: its run dir and a way to ask it to stop after the step."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.stop_requests = 0

    def request_stop(self) -> None:
        self.stop_requests += 1

    def checkpoint(self, state: str) -> None:
        (self.run_dir / "status.json").write_text(json.dumps({"state": state}))


@pytest.fixture
def submitit_job(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """A submitit job's process: its executor named, its requeue handler on USR2 (it records the calls)."""
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")
    requeued: list[int] = []
    previous = signal.signal(signal.SIGUSR2, lambda number, frame: requeued.append(number))
    yield requeued
    signal.signal(signal.SIGUSR2, previous)


def run_guarded(run: Run, send: signal.Signals | None, final_state: str) -> None:
    with requeue_on_preemption(run):
        if send is not None:
            os.kill(os.getpid(), send)
            os.kill(os.getpid(), send)  # a repeated signal asks again, harmlessly
        run.checkpoint(final_state)


def test_warning_signal_stops_after_the_step_then_hands_over_to_submitit(
    tmp_path: Path, submitit_job: list[int]
) -> None:
    run = Run(tmp_path)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as exited:
        run_guarded(run, signal.SIGUSR2, "stopped")
    assert run.stop_requests == 2 and submitit_job == [signal.SIGUSR2]
    assert exited.value.code == TERMINATED_EXIT_CODE  # if submitit's handler returns, the job still ends
    assert signal.getsignal(signal.SIGTERM) is before  # handlers restored


def test_sigterm_stops_after_the_step_and_exits_without_requeueing(tmp_path: Path, submitit_job: list[int]) -> None:
    run = Run(tmp_path)
    with pytest.raises(SystemExit) as exited:
        run_guarded(run, signal.SIGTERM, "stopped")
    assert run.stop_requests == 2 and submitit_job == [] and exited.value.code == TERMINATED_EXIT_CODE


def test_a_finished_run_or_no_signal_ends_normally(tmp_path: Path, submitit_job: list[int]) -> None:
    run_guarded(Run(tmp_path), signal.SIGUSR2, "done")
    run_guarded(Run(tmp_path), None, "stopped")
    assert submitit_job == []


def test_the_requeue_command_outlives_the_sigterm_that_its_requeue_sends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`scontrol requeue` of the job itself has SLURM SIGTERM every process of the job, scontrol included;
    CI once saw scontrol die so, and the sweep failed on submitit's CalledProcessError. Here a child that
    SIGTERMs its parent and itself stands in for scontrol, and submitit's SIGTERM handler is its bypass."""
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")
    bypassed: list[int] = []

    def submitit_requeue(number: int, frame: object) -> None:
        subprocess.check_call(["sh", "-c", "kill -TERM $PPID $$"], timeout=30)

    def submitit_bypass(number: int, frame: object) -> None:
        bypassed.append(number)

    previous = {
        signal.SIGUSR2: signal.signal(signal.SIGUSR2, submitit_requeue),
        signal.SIGTERM: signal.signal(signal.SIGTERM, submitit_bypass),
    }
    try:
        with pytest.raises(SystemExit) as exited:
            run_guarded(Run(tmp_path), signal.SIGUSR2, "stopped")
        assert exited.value.code == TERMINATED_EXIT_CODE and bypassed == []
        assert signal.getsignal(signal.SIGTERM) is submitit_bypass  # restored after the hand-over
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
