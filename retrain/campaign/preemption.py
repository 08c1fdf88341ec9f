"""Graceful stops: SIGTERM, Ctrl-C and a cluster's pre-emption finish the step, checkpoint, then end the run.

Anywhere (a terminal, a container, `kill`, `docker stop`, systemd, any scheduler): SIGTERM or SIGINT
(Ctrl-C) asks the trainer to stop; it finishes the step in flight, writes a checkpoint, records
`stopped` in status.json, and the process exits with 128 + the signal's number (143, 130). Started again
in the same run dir, the run resumes from that checkpoint. A second Ctrl-C stops at once, without one.

In a job launched by submitit (`hydra/launcher=slurm` or `local`), SLURM warns the job `signal_delay_s`
before its time limit (and submitit's tests, or a pre-empting scheduler, do the same) with SIGUSR2.
submitit's own handler checkpoints the *launcher* and requeues at once, killing the step in flight: the
run would then resume from its last periodic checkpoint and redo up to `save_every - 1` steps. With this
guard the signal only asks the trainer to stop; it finishes the step, checkpoints, returns, and only
then is submitit's handler called to requeue and exit. The requeued job re-enters the same run dir and
resumes from that checkpoint. SIGTERM there (`scancel`, `scontrol requeue`, the time limit itself, a
node going down) stops the same way, and the job exits without a result, so SLURM's own requeue or
cancellation stands — if the step ends within SLURM's KillWait. A data-parallel run (torchrun, a job of several
tasks) stops every rank after the same step; rank 0 writes the checkpoint and requeues, and the other ranks exit
on rank 0's state once it has (tests/campaign/test_slurm_distributed.py).

    with requeue_on_preemption(trainer):
        status = trainer.run()
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

import torch.distributed as dist

from retrain.distributed.world import active, from_main, gather_objects
from retrain.housekeeping.console import resume_command
from retrain.housekeeping.rundir import RunDir

log = logging.getLogger("retrain")

TERMINATED_EXIT_CODE = 128 + signal.SIGTERM


class Stoppable(Protocol):
    run_dir: Path

    def request_stop(self) -> None: ...


def preemption_signal() -> signal.Signals | None:
    """The signal submitit requeues this job on, or None outside a submitit job.

    submitit names it in its public `JobEnvironment.USR_SIG` ("USR2" unless the job's environment sets
    SUBMITIT_PREEMPT_SIGNAL), the same name it passes to `sbatch --signal`.
    """
    if not os.environ.get("SUBMITIT_EXECUTOR"):
        return None
    from submitit import JobEnvironment

    return signal.Signals["SIG" + JobEnvironment.USR_SIG]


@contextmanager
def requeue_on_preemption(trainer: Stoppable) -> Iterator[None]:
    """Turn SIGTERM, SIGINT and submitit's pre-emption signal into: finish the step, checkpoint, then exit
    (or requeue). Signal handlers belong to the main thread: elsewhere the signals keep their handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    warning = preemption_signal()
    submitit_handler = signal.getsignal(warning) if warning is not None else None
    requeue = submitit_handler if callable(submitit_handler) else None
    if requeue is None:
        warning = None
    received: list[int] = []

    def on_signal(number: int, frame: Any) -> None:
        if number == signal.SIGINT and number in received:
            raise KeyboardInterrupt  # Ctrl-C twice: stop now, without a checkpoint
        if number not in received:
            log.warning(
                "Received %s: stopping after this step to checkpoint%s.%s",
                signal.Signals(number).name,
                " and requeue" if number == warning else "",
                " Press Ctrl-C again to stop at once, without one." if number == signal.SIGINT else "",
            )
            received.append(number)
        trainer.request_stop()

    handled = [signal.SIGTERM, signal.SIGINT, *([warning] if warning is not None else [])]
    previous = {number: signal.signal(number, on_signal) for number in handled}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
    state, received = _agreed(trainer.run_dir, received)
    if state == "done" or not received:
        return
    if requeue is not None and warning in received:
        log.warning("Checkpointed (state %s); handing over to submitit to requeue this job.", state)
        try:
            with _sigterm_ignored():
                requeue(warning, None)  # submitit: checkpoint the launcher, `scontrol requeue`, exit (rank 0 only)
        finally:  # the other ranks exit once the job is requeued: one that exits with an error may end the job's
            from_main(None)  # other tasks before (srun --kill-on-bad-exit, SLURM's KillOnBadExit)
    first = received[0]
    name = signal.Signals(first).name
    if requeue is not None:
        log.warning("Checkpointed after %s (state %s); exiting, for SLURM to requeue or cancel this job.", name, state)
    else:  # the default run dir is time-stamped: the same command again would start over at step 0
        log.warning(
            "Checkpointed after %s (state %s); exiting. Resume with:\n  %s",
            name,
            state,
            resume_command(trainer.run_dir),
        )
    raise SystemExit(128 + first if first in (signal.SIGTERM, signal.SIGINT) else TERMINATED_EXIT_CODE)


def _agreed(run_dir: Path, received: list[int]) -> tuple[str | None, list[int]]:
    """The run's state as rank 0 recorded it and the signals any rank received, the same on every rank.

    One process: its own. Data-parallel, another rank's trainer returns before rank 0 has written the stop's
    checkpoint and status: reading status.json itself, it would say "checkpointed (state running)" and exit
    while rank 0 still writes (a rank's early exit ends the others under torchrun, or SLURM's KillOnBadExit).
    Waiting here for rank 0, every rank also acts on the same signals (a SIGUSR2 that reached one rank only
    still requeues the job)."""
    main = not active() or dist.get_rank() == 0
    state = RunDir(run_dir).read_status().get("state") if main else None
    noted = gather_objects((state, received))
    signals = [number for _, numbers in noted for number in numbers]
    return noted[0][0], sorted(set(signals), key=signals.index)


@contextmanager
def _sigterm_ignored() -> Iterator[None]:
    """Requeueing its own job makes SLURM SIGTERM every process of the job, `scontrol requeue` included: if
    that lands before scontrol exits, submitit raises CalledProcessError for a requeue that was made, and the
    sweep fails (seen in CI). An ignored signal stays ignored across exec, so scontrol lives to exit 0."""
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
