"""The producer: samples and scores batches up to `training.max_staleness` steps ahead of the trainer (docs/async.md).

One thread prepares the steps' batches in step order: it draws a step's prompts, samples them, scores them and runs
dynamic sampling's refill rounds, exactly as the trainer does on its own thread at max_staleness 0, so the data
stream (which prompts, which seeds) never depends on k or on timing.

Which weights a batch is sampled with does not depend on timing either: the schedule pins batch t to the weights
step `weights_for(t)` trains with, t − k, but never before the last barrier at or before t (the process's first
step, a checkpoint, a held-out evaluation: nothing is sampled ahead across them, so a run resumed from a checkpoint
samples what the uninterrupted run did). The trainer releases step j's weights when step j starts (the engine serves
them since the sync that ended step j − 1). An engine that serves several versions at once (a server's adapters,
retrain.inference.base.ServesVersions) samples each batch with the version it is pinned to while newer ones load;
before it hands any other engine newer weights, the trainer waits for every batch pinned to older ones
(`wait_through`). So batch t trains at policy lag t − weights_for(t) <= k, the same in every run of the config,
stopped and resumed or not.

Every wait is bounded by the work it waits for: a producer that fails (a server error, a reward that raises, a
stop request's interrupt) records the error, and the trainer raises it when it needs that batch; a wait that finds
the thread gone without a batch or an error raises instead of hanging.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from retrain.training.dynamic_sampling import ScoredGroups


@dataclass(frozen=True)
class PreparedBatch:
    """A step's batch, sampled and scored (dynamic sampling's refill rounds included), ready for its advantages."""

    step: int
    groups: ScoredGroups
    dapo_metrics: dict[str, int]
    served_version: int  # the engine's weights version it was sampled with
    data_before: dict[str, Any]  # the data source's state before its prompts were drawn
    data_after: dict[str, Any]  # ... and once they (and its refill rounds') were drawn
    sample_time_s: float = 0.0  # sampling its first round
    reward_time_s: float = 0.0  # scoring it, refill rounds included
    producer_wait_s: float = 0.0  # the producer's wait for the weights it is pinned to


@dataclass(frozen=True)
class Schedule:
    """Which weights each batch is sampled with: see the module docstring."""

    max_staleness: int
    first: int  # the first step this process trains (0, or where it resumed)
    max_steps: int
    barrier: Callable[[int], bool]  # whether something uses the engine before step t (a checkpoint, an evaluation)

    def weights_for(self, step: int) -> int:
        """The step whose weights batch `step` is sampled with."""
        lowest = max(step - self.max_staleness, self.first)
        for boundary in range(step, lowest, -1):
            if self.barrier(boundary):
                return boundary
        return lowest

    def last_on(self, step: int) -> int:
        """The last batch sampled with weights of step `step` or older: what must be done before newer weights load."""
        last = step
        while last + 1 < self.max_steps and self.weights_for(last + 1) <= step:
            last += 1
        return last


class Producer:
    """Runs `prepare(step)` for each step in order on its own thread, as the schedule releases its weights."""

    POLL_S = 0.2  # how often a waiting trainer looks at the thread's liveness and at a stop request
    # how long a stop lets the batches sampled ahead finish (so its checkpoint keeps them) before interrupting them
    STOP_GRACE_S = 30.0

    def __init__(
        self,
        prepare: Callable[[int], PreparedBatch],
        schedule: Schedule,
        ready: list[PreparedBatch],
        interrupt: Callable[[], None] | None = None,
    ) -> None:
        """`ready`: the batches a checkpoint kept (steps first, first + 1, ...); `interrupt` cancels a `prepare` in
        flight (an engine's `interrupt`), used when a stop comes while the trainer waits for its step's batch."""
        self._prepare = prepare
        self.schedule = schedule
        self._interrupt = interrupt
        self._cond = threading.Condition()
        self._ready = {batch.step: batch for batch in ready}
        self._next = schedule.first + len(ready)  # the next batch to prepare
        self._busy = False
        self._released = -1  # the newest step whose weights the engine serves and may sample with
        self._failure: tuple[int, BaseException] | None = None
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="retrain-producer", daemon=True)
        self._thread.start()

    # ---- the trainer's side -------------------------------------------------------------
    def release(self, step: int) -> None:
        """The engine serves step `step`'s weights: batches pinned to them may be sampled."""
        with self._cond:
            self._released = step
            self._cond.notify_all()

    def take(self, step: int, stop: threading.Event) -> tuple[PreparedBatch, float]:
        """Step `step`'s batch and the seconds the trainer waited for it. A stop requested while it waits interrupts
        the engine (when it can be), so a stuck request never holds the stop; the batch's error is raised here."""
        started = time.perf_counter()
        interrupted = False
        with self._cond:
            while step not in self._ready:
                self._raise_failure(step)
                if stop.is_set() and not interrupted and self._interrupt is not None:
                    self._interrupt()
                    interrupted = True
                self._cond.wait(self.POLL_S)
            return self._ready.pop(step), time.perf_counter() - started

    def wait_through(self, step: int, stop: threading.Event) -> None:
        """Wait until every batch up to `step` is prepared; a failure among them is raised. After a stop request the
        batches get STOP_GRACE_S to finish (the stop's checkpoint keeps them), then the engine is interrupted (when it
        can be): a stalled server never holds a stop longer."""
        last = min(step, self.schedule.max_steps - 1)
        stopped_at: float | None = None  # when this wait saw the stop request
        interrupted = False
        with self._cond:
            self._raise_failure(last)
            while self._next <= last or (self._busy and self._next - 1 <= last):
                if stop.is_set() and stopped_at is None:
                    stopped_at = time.perf_counter()
                late = stopped_at is not None and time.perf_counter() - stopped_at > self.STOP_GRACE_S
                if late and not interrupted and self._interrupt is not None:
                    self._interrupt()
                    interrupted = True
                self._cond.wait(self.POLL_S)
                self._raise_failure(last)

    def ahead(self) -> list[PreparedBatch]:
        """The batches prepared and not taken yet, in step order (what a checkpoint keeps)."""
        with self._cond:
            return [self._ready[step] for step in sorted(self._ready)]

    def close(self) -> None:
        """Stop the thread: it prepares nothing more, a `prepare` in flight is interrupted when it can be and waited
        for otherwise (an in-process engine finishes its generate)."""
        with self._cond:
            self._closing = True
            busy = self._busy
            self._cond.notify_all()
        if busy and self._interrupt is not None:
            self._interrupt()
        self._thread.join()

    def _raise_failure(self, step: int) -> None:
        """Raise the producer's error when it failed at `step` or before; RuntimeError when it is gone without one."""
        if self._failure is not None and self._failure[0] <= step:
            raise self._failure[1]
        if not self._thread.is_alive() and self._failure is None:
            raise RuntimeError(f"the producer thread ended before preparing step {step}'s batch")

    # ---- the producer's thread ----------------------------------------------------------
    def _run(self) -> None:
        while True:
            free = time.perf_counter()
            with self._cond:
                while not self._closing and not self._may_start(self._next):
                    self._cond.wait()
                if self._closing:
                    return
                step = self._next
                self._busy = True
                self._next += 1
            waited = time.perf_counter() - free
            try:
                batch = self._prepare(step)
            except BaseException as error:  # the trainer raises it when it needs this batch
                with self._cond:
                    self._failure = (step, error)
                    self._busy = False
                    self._cond.notify_all()
                return
            with self._cond:
                self._ready[step] = dataclasses.replace(batch, producer_wait_s=waited)
                self._busy = False
                self._cond.notify_all()

    def _may_start(self, step: int) -> bool:
        return step < self.schedule.max_steps and self.schedule.weights_for(step) <= self._released
