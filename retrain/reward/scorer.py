"""Scores a step's completions in parallel worker processes, each row bounded by a timeout.

Why processes and not threads: a Python function that never returns cannot be stopped inside a
thread, and math-verify times itself with SIGALRM, which works only in a main thread. A worker
process runs the reward in its main thread, and a worker stuck past the timeout is killed and
replaced, so one bad completion costs at most `timeout_s` and the next step finds a full pool. A
worker whose memory grew past `max_worker_rss_mb` (a reward that leaks, or read a huge reply) is
replaced between chunks the same way (measured from /proc, so on Linux only). Each worker leads a
process group of its own, and stopping it kills the group: a helper process its reward started (a
sandbox, a server) never outlives it.

Workers are fresh interpreters (`python -m retrain.reward.worker`), never forks of the trainer:
forking a process that holds CUDA contexts and thread pools can deadlock the child, and the
`spawn`/`forkserver` start methods would re-run an unguarded user script in every worker. The
reward is pickled once per worker, so it must be importable by name (a module-level function, a
`functools.partial` of one, or an instance of a module-level class); that is checked when the
scorer starts, before any model loads.

The one exception: built-in rewards known to be pure and fast (IN_PROCESS_REWARDS: `reward=match`, a
linear scan of the completion with no I/O and no native code) cannot hang or take the interpreter down,
so they run in the trainer's own process, row by row with the same verdicts, and no worker starts. A
worker round trip costs more than such a reward: on the quickstart step, ~9 ms of ~130 against ~0.4.
Every other reward, plugins and `reward=math` (math-verify can hang) included, runs in the workers.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import math
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, Protocol

import torch

from retrain.config import ScoringConfig
from retrain.errors import ConfigError, RewardFailureError, RewardOutputError, RewardWorkerError
from retrain.plugins import plugin_name
from retrain.reward import worker as worker_module
from retrain.reward.checks import bounded
from retrain.reward.match import match_reward
from retrain.types import Example

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 120.0  # loading a reward imports its module (sympy alone takes ~1 s)
ASYNC_GRACE_S = 2.0  # async rows time themselves; the parent kills a worker this much later
CHUNKS_PER_WORKER = 4  # sync rewards: small chunks balance slow rows across workers
MAX_AUTO_WORKERS = 8
# Built-in rewards scored in the trainer's process (see the module docstring): pure, synchronous, linear time.
IN_PROCESS_REWARDS: tuple[Callable[..., Any], ...] = (match_reward,)


@dataclass
class ScoreResult:
    """Row-aligned rewards for one call, plus what went wrong (failed and excluded rows hold 0.0)."""

    rewards: torch.Tensor  # [N] float32
    errors: int = 0  # rows that raised, timed out or took their worker down: they score 0.0
    timeouts: int = 0  # of those, rows that ran out of time
    failures: dict[int, str] = field(default_factory=dict)  # row -> why it failed
    excluded: dict[int, str] = field(default_factory=dict)  # row -> why the reward gave no verdict (NoVerdict)

    def excluded_mask(self) -> torch.Tensor:
        """[N] bool: rows to leave out of training and of the accuracy figures."""
        mask = torch.zeros(self.rewards.shape[0], dtype=torch.bool)
        mask[list(self.excluded)] = True
        return mask


def fill_excluded(rewards: torch.Tensor, excluded: torch.Tensor) -> torch.Tensor:
    """Rewards [B, G] in which each excluded row holds the mean of its group's other rows (0 when none is left).

    A group's advantages are then those of its scored rows alone (exactly so for GRPO and MaxRL, whose
    baseline is the mean), and an excluded row's own advantage is 0; the trainer also masks it out.
    """
    kept = (~excluded).float()
    mean = (rewards * kept).sum(dim=1, keepdim=True) / kept.sum(dim=1, keepdim=True).clamp_min(1.0)
    return torch.where(excluded, mean, rewards)


class Scorer(Protocol):
    """What the trainer asks of its reward scorer."""

    def score(self, responses: list[str], examples: list[Example]) -> ScoreResult:
        """Rewards for row-aligned responses and examples; failed rows score 0.0 and are counted, rows the
        reward gave no verdict for are listed in `excluded`."""

    def close(self) -> None:
        """Stop whatever runs the reward."""


def is_async_reward(reward_fn: Callable[..., Any]) -> bool:
    """An `async def` function, a partial of one, or an instance whose `__call__` is `async def`."""
    target: Any = reward_fn
    while isinstance(target, functools.partial):
        target = target.func
    return inspect.iscoroutinefunction(target) or inspect.iscoroutinefunction(type(target).__call__)


def in_process_form(reward_fn: Callable[..., Any]) -> Callable[..., Any] | None:
    """`reward_fn` as a plain call when its function is in IN_PROCESS_REWARDS, else None (it runs in the workers).

    Partials are unwrapped, Hydra's `_partial_: true` wrapper included: it re-authorizes its target on every
    call (~0.1 ms, 50x the match itself), and the target is known to be one of ours here.
    """
    target: Any = reward_fn
    args: tuple[Any, ...] = ()
    keywords: dict[str, Any] = {}
    while isinstance(target, functools.partial):
        args, keywords = (*target.args, *args), {**target.keywords, **keywords}
        target = target.func
    if not any(target is known for known in IN_PROCESS_REWARDS):  # by identity: a plugin may be unhashable
        return None
    return functools.partial(target, *args, **keywords)


def default_workers() -> int:
    """One worker per available core, at least 2 (a hung row must not stall the rest), at most 8."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(2, min(MAX_AUTO_WORKERS, cores))


class _Worker:
    """One scoring process, the rows it still owes, and when it must have answered by."""

    def __init__(self, process: subprocess.Popen[bytes], conn: Connection) -> None:
        self.process = process
        self.conn = conn
        self.ready = False
        self.rows: list[int] = []  # dispatched, not yet answered, in dispatch order
        self.deadline = math.inf
        self.started_at = time.monotonic()

    def stop(self, grace_s: float) -> None:
        if self.process.poll() is None and grace_s > 0:
            try:
                self.conn.send(None)
                self.process.wait(grace_s)
            except (OSError, subprocess.TimeoutExpired):
                pass
        # the worker leads its own process group (`start_new_session`), so what its reward started goes with it
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        self.conn.close()


def _stop_workers(workers: list[_Worker]) -> None:
    for worker in workers:
        worker.stop(grace_s=0.0)


class RewardScorer:
    """Runs `reward_fn(response, reference, **example.extra)` for every row of a step, in parallel
    (in this process for the built-ins in IN_PROCESS_REWARDS; `workers` then start none).

    A row whose reward raises, runs past `timeout_s`, or kills its worker scores 0.0 and is counted
    in `errors` (and `timeouts`); a row whose reward raises NoVerdict is `excluded`. A reward that
    returns anything but one finite number raises RewardOutputError, since that is a bug in the reward
    rather than a bad completion, and one that fails or excludes every row of `max_failing_steps`
    calls in a row raises RewardFailureError: a run whose reward never answers would train on nothing.
    """

    def __init__(
        self,
        reward_fn: Callable[..., Any],
        name: str | None = None,
        timeout_s: float = 30.0,
        workers: int = 0,
        max_failing_steps: int = 3,
        max_worker_rss_mb: int = 4096,
    ) -> None:
        ScoringConfig(timeout_s, workers, max_failing_steps, max_worker_rss_mb)  # its checks, as for the config
        if not callable(reward_fn):
            raise ConfigError(f"reward {name or reward_fn!r} is not callable")
        if isinstance(reward_fn, functools.partial) and inspect.isclass(reward_fn.func):  # each call would build one
            raise ConfigError(
                f"reward {plugin_name(reward_fn.func)} is a class: set reward._partial_=false, so that it is built "
                "once with its arguments and then called per completion"
            )
        self.name = name or plugin_name(reward_fn)
        self.timeout_s = float(timeout_s)
        self.max_failing_steps = max_failing_steps
        self.max_worker_rss_mb = max_worker_rss_mb
        self.failing_steps = 0  # calls in a row in which no row got a score
        self.concurrent = is_async_reward(reward_fn)
        self._local_call = in_process_form(reward_fn)  # None: the workers score
        try:
            self._reward_blob = pickle.dumps(reward_fn)
        except Exception as exc:
            raise ConfigError(
                f"reward {self.name} cannot be sent to the scoring worker processes ({exc}); define "
                f"it at module level (not a lambda or a nested function) so it can be imported by name"
            ) from exc
        count = 0 if self._local_call is not None else workers or default_workers()
        self._workers: list[_Worker] = [self._start_worker() for _ in range(count)]
        self._finalizer = weakref.finalize(self, _stop_workers, self._workers)
        try:
            self._wait_until_ready()
        except BaseException:
            self.close()
            raise

    # ---- public API ------------------------------------------------------------------------
    def score(self, responses: list[str], examples: list[Example]) -> ScoreResult:
        """Rewards for row-aligned `responses` and `examples` (row n is scored against examples[n])."""
        if len(responses) != len(examples):
            raise ValueError(
                f"score() got {len(responses)} responses but {len(examples)} examples; they must be row-aligned"
            )
        if not self._finalizer.alive:
            raise RuntimeError(f"reward scorer for {self.name} is closed")
        rows = [
            (n, response, example.reference, dict(example.extra))
            for n, (response, example) in enumerate(zip(responses, examples))
        ]
        outcome = _Outcome(len(rows))
        try:
            self._run(rows, outcome)
        except BaseException:
            # Workers still busy with this call would answer into the next one: replace them.
            self._replace(worker for worker in self._workers if worker.rows)
            raise
        self._recycle_bloated(self._workers)  # between steps: the replacements load while the trainer trains
        if outcome.failures:
            first = min(outcome.failures)
            log.warning(
                "reward %s: %d of %d completions failed and scored 0 (%d timed out); first, row %d: %s",
                self.name,
                len(outcome.failures),
                len(rows),
                outcome.timeouts,
                first,
                outcome.failures[first],
            )
        if outcome.excluded:
            first = min(outcome.excluded)
            log.warning(
                "reward %s gave no verdict for %d of %d completions (left out of training); first, row %d: %s",
                self.name,
                len(outcome.excluded),
                len(rows),
                first,
                outcome.excluded[first],
            )
        self._count_failing_step(outcome, len(rows))
        return ScoreResult(
            rewards=torch.tensor(outcome.rewards, dtype=torch.float32),
            errors=len(outcome.failures),
            timeouts=outcome.timeouts,
            failures=dict(sorted(outcome.failures.items())),
            excluded=dict(sorted(outcome.excluded.items())),
        )

    def _count_failing_step(self, outcome: _Outcome, size: int) -> None:
        """RewardFailureError once `max_failing_steps` calls in a row got no score for any row."""
        unscored = {**outcome.failures, **outcome.excluded}
        if size == 0:  # nothing asked: nothing learned
            return
        if len(unscored) < size:
            self.failing_steps = 0
            return
        self.failing_steps += 1
        if self.max_failing_steps and self.failing_steps >= self.max_failing_steps:
            raise RewardFailureError(
                f"reward {self.name} scored none of the completions of {self.failing_steps} steps in a row "
                f"(a step here is a training step or an evaluation batch); the last step's first failure: "
                f"{unscored[min(unscored)]}. Fix the reward (or the server it asks), or set "
                "scoring.max_failing_steps=0 to train on through such steps"
            )

    def close(self) -> None:
        """Stop the worker processes (idempotent)."""
        if self._finalizer.detach() is not None:
            for worker in self._workers:
                worker.stop(grace_s=1.0)

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---- the dispatch loop -----------------------------------------------------------------
    def _run(self, rows: list[worker_module.Row], outcome: _Outcome) -> None:
        if self._local_call is not None:
            for row in rows:
                self._record(*worker_module.score_row(self._local_call, self.name, row), rows, outcome)
            return
        size = max(1, math.ceil(len(rows) / len(self._workers)))
        if not self.concurrent:
            size = math.ceil(size / CHUNKS_PER_WORKER)
        pending: deque[list[int]] = deque(
            list(range(start, min(start + size, len(rows)))) for start in range(0, len(rows), size)
        )
        while pending or any(worker.rows for worker in self._workers):
            for worker in self._workers:
                if worker.ready and not worker.rows and pending and not self._recycle_bloated([worker]):
                    self._dispatch(worker, pending.popleft(), rows)
            self._await_messages(rows, outcome, pending)

    def _dispatch(self, worker: _Worker, indices: list[int], rows: list[worker_module.Row]) -> None:
        worker.rows = list(indices)
        with contextlib.suppress(OSError):  # it just died; the next wait() reads the EOF and handles it as a crash
            worker.conn.send([rows[n] for n in indices])
        worker.deadline = time.monotonic() + self.timeout_s + (ASYNC_GRACE_S if self.concurrent else 0.0)

    def _await_messages(self, rows: list[worker_module.Row], outcome: _Outcome, pending: deque[list[int]]) -> None:
        busy = [worker for worker in self._workers if worker.rows or not worker.ready]
        next_deadline = min((self._deadline_of(worker) for worker in busy), default=math.inf)
        ready_conns = set(wait([worker.conn for worker in busy], timeout=max(0.0, next_deadline - time.monotonic())))
        for worker in busy:
            if worker.conn in ready_conns:
                self._drain(worker, rows, outcome, pending)
        now = time.monotonic()
        for worker in list(self._workers):
            if (worker.rows or not worker.ready) and now >= self._deadline_of(worker):
                self._on_deadline(worker, outcome, pending)

    def _deadline_of(self, worker: _Worker) -> float:
        return worker.deadline if worker.ready else worker.started_at + STARTUP_TIMEOUT_S

    def _drain(
        self, worker: _Worker, rows: list[worker_module.Row], outcome: _Outcome, pending: deque[list[int]]
    ) -> None:
        """Read every message the worker has sent; a closed pipe means the worker died."""
        try:
            while worker.conn.poll():
                kind, index, payload = worker.conn.recv()
                self._handle(worker, kind, index, payload, rows, outcome)
        except (EOFError, OSError):
            self._on_crash(worker, outcome, pending)

    def _handle(
        self, worker: _Worker, kind: str, index: int, payload: Any, rows: list[worker_module.Row], outcome: _Outcome
    ) -> None:
        if kind == "ready":
            worker.ready = True
            return
        if kind == "init_error":
            cause = payload.strip().splitlines()[-1] if payload.strip() else "no traceback"
            raise RewardWorkerError(f"a scoring worker could not load reward {self.name} ({cause})", details=payload)
        worker.rows.remove(index)
        if not self.concurrent:  # the worker starts its next row now
            worker.deadline = time.monotonic() + self.timeout_s
        self._record(kind, index, payload, rows, outcome)

    @staticmethod
    def _record(kind: str, index: int, payload: Any, rows: list[worker_module.Row], outcome: _Outcome) -> None:
        """A row's verdict, however it was scored."""
        if kind == "bad_output":
            raise RewardOutputError(f"{payload} (row {index}, completion {rows[index][1][:200]!r})")
        if kind == "ok":
            outcome.rewards[index] = payload
        elif kind == "excluded":
            outcome.excluded[index] = bounded(payload)
        else:
            outcome.fail(index, bounded(payload), timed_out=kind == "timeout")

    def _on_deadline(self, worker: _Worker, outcome: _Outcome, pending: deque[list[int]]) -> None:
        if not worker.ready:
            raise RewardWorkerError(f"a scoring worker did not load reward {self.name} within {STARTUP_TIMEOUT_S:g} s")
        why = f"no result after {self.timeout_s:g} s (worker killed)"
        self._fail_current(worker, outcome, pending, why, timed_out=True)
        self._replace([worker])

    def _on_crash(self, worker: _Worker, outcome: _Outcome, pending: deque[list[int]]) -> None:
        try:
            code: int | None = worker.process.wait(5.0)
        except subprocess.TimeoutExpired:
            code = None
        if not worker.ready:
            raise RewardWorkerError(f"a scoring worker exited (code {code}) while loading reward {self.name}")
        why = f"the scoring worker died (exit code {code}) while scoring this completion"
        self._fail_current(worker, outcome, pending, why, timed_out=False)
        self._replace([worker])

    def _fail_current(
        self, worker: _Worker, outcome: _Outcome, pending: deque[list[int]], why: str, timed_out: bool
    ) -> None:
        """A sync worker was on its first unanswered row: fail it, give the rest to others.

        An async worker ran its whole chunk at once, so every unanswered row shares the blame.
        """
        blamed = worker.rows if self.concurrent else worker.rows[:1]
        for index in blamed:
            outcome.fail(index, why, timed_out=timed_out)
        rest = worker.rows[len(blamed) :]
        if rest:
            pending.appendleft(rest)
        worker.rows = []

    # ---- worker lifecycle --------------------------------------------------------------------
    def _start_worker(self) -> _Worker:
        parent_end, child_end = socket.socketpair()
        child_fd = child_end.detach()
        try:
            process = subprocess.Popen(
                [sys.executable, "-m", worker_module.__name__, str(child_fd)],
                pass_fds=(child_fd,),
                stdin=subprocess.DEVNULL,
                env=_worker_env(),
                start_new_session=True,  # a group of its own: `stop` kills the processes a reward forked too
            )
        finally:
            os.close(child_fd)  # the worker holds the only copy, so its death reads as EOF here
        conn = Connection(parent_end.detach())
        worker = _Worker(process, conn)
        with contextlib.suppress(OSError):  # it died on start; the next wait() reads the EOF and reports it
            conn.send((list(sys.path), self._reward_blob, self.name, self.concurrent, self.timeout_s))
        return worker

    def _replace(self, workers: Any) -> None:
        for old in list(workers):
            old.stop(grace_s=0.0)
            self._workers[self._workers.index(old)] = self._start_worker()

    def _recycle_bloated(self, idle: list[_Worker]) -> bool:
        """Replace idle workers whose resident memory is past `max_worker_rss_mb` (0: no limit); True if any was."""
        if not self.max_worker_rss_mb:
            return False
        bloated = []
        for worker in idle:
            rss = resident_mb(worker.process.pid)
            if rss is not None and rss > self.max_worker_rss_mb:
                log.warning(
                    "reward %s: a scoring worker holds %.0f MB (scoring.max_worker_rss_mb=%d); replacing it",
                    self.name,
                    rss,
                    self.max_worker_rss_mb,
                )
                bloated.append(worker)
        self._replace(bloated)
        return bool(bloated)

    def _wait_until_ready(self) -> None:
        outcome = _Outcome(0)
        while not all(worker.ready for worker in self._workers):
            self._await_messages([], outcome, deque())


def resident_mb(pid: int) -> float | None:
    """A process's resident memory in MB, from /proc; None where there is no /proc (or the process is gone)."""
    try:
        with open(f"/proc/{pid}/statm") as handle:
            pages = int(handle.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def _worker_env() -> dict[str, str]:
    """The parent's environment, with retrain importable however the parent found it."""
    package_root = str(Path(worker_module.__file__).resolve().parents[2])
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": package_root + (os.pathsep + path if path else "")}


class _Outcome:
    """What one score() call has learned so far."""

    def __init__(self, size: int) -> None:
        self.rewards = [0.0] * size
        self.failures: dict[int, str] = {}
        self.excluded: dict[int, str] = {}
        self.timeouts = 0

    def fail(self, index: int, why: str, timed_out: bool) -> None:
        self.rewards[index] = 0.0
        self.failures[index] = why
        self.timeouts += int(timed_out)
