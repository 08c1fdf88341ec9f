"""Graceful pre-emption for runs launched by submitit (`hydra/launcher=slurm` or `local`).

SLURM warns a job `signal_delay_s` before its time limit (and submitit's tests, or a pre-empting
scheduler, do the same) with SIGUSR2. submitit's own handler checkpoints the *launcher* and
requeues at once, killing the step in flight: the run would then resume from its last periodic
checkpoint and redo up to `save_every - 1` steps. With this guard the signal only asks the trainer
to stop; it finishes the step, checkpoints, returns, and only then is submitit's handler called to
requeue and exit. The requeued job re-enters the same run dir and resumes from that checkpoint.

SIGTERM (`scancel`, `scontrol requeue`, the time limit itself, a node going down) also asks the
trainer to checkpoint after the step in flight; the job then exits without a result, so SLURM's
own requeue or cancellation stands and the run resumes from there rather than from an older
periodic checkpoint — if the step ends within SLURM's KillWait.

    with requeue_on_preemption(trainer):
        status = trainer.run()
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

from retrain.rundir import RunDir

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
    """Turn submitit's pre-emption signal into: finish the step, checkpoint, then requeue."""
    warning = preemption_signal()
    requeue = signal.getsignal(warning) if warning is not None else None
    if warning is None or not callable(requeue):
        yield
        return
    received: set[int] = set()

    def on_signal(number: int, frame: Any) -> None:
        if number not in received:
            log.warning(
                "Received %s: stopping after this step to checkpoint%s.",
                signal.Signals(number).name,
                " and requeue" if number == warning else "",
            )
        received.add(number)
        trainer.request_stop()

    previous = {number: signal.signal(number, on_signal) for number in (warning, signal.SIGTERM)}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
    state = RunDir(trainer.run_dir).read_status().get("state")
    if state == "done" or not received:
        return
    if warning in received:
        log.warning("Checkpointed (state %s); handing over to submitit to requeue this job.", state)
        requeue(warning, None)  # submitit: checkpoint the launcher, `scontrol requeue`, exit
    log.warning("Checkpointed after SIGTERM (state %s); exiting for SLURM to requeue or cancel this job.", state)
    raise SystemExit(TERMINATED_EXIT_CODE)  # no result: the job did not finish
