"""What runs inside a scoring worker process: load the reward once, then score chunks of rows.

A worker is a fresh interpreter (`python -m retrain.reward.worker FD`) talking over a socket: no
fork of a trainer that holds CUDA contexts and thread pools, and no re-import of the user's main
module. Its first message from the parent is the setup: the parent's sys.path (so plugins import
the same way), the pickled reward, the reward's name, whether to run rows concurrently, the timeout.

Messages are `(kind, row, payload)` tuples. The parent then sends a chunk (a list of
`(row, response, reference, extra)`) or None to stop; the worker answers `("ready", -1, None)` once
the reward is loaded (or `("init_error", -1, traceback)`), then one message per row, as soon as that
row is done: `("ok", row, value)`, `("error", row, why)`, `("timeout", row, why)` (async rewards
only; the parent times sync rows itself), `("excluded", row, why)` (the reward raised NoVerdict) or
`("bad_output", row, message)`. Every `why` is bounded in size, and so is what a reward prints: the
worker's stdout and stderr (its file descriptors, so native code too) pass through a pipe that lets
OUTPUT_LIMIT bytes through per chunk and counts the rest, so a reward printing megabytes per completion
cannot flood the trainer's console or its job's log.

Rewards run in the worker's main thread, so libraries that time themselves with signals
(math-verify) work here, and a reward that never returns can be killed with its process.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import pickle
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from retrain.errors import RewardOutputError
from retrain.reward.checks import NoVerdict, checked_reward_value, describe_exception

Row = tuple[int, str, str, dict[str, Any]]
Message = tuple[str, int, Any]
# What a reward may not swallow into a score of 0: the worker's own exit and cancellation.
_PASS_THROUGH = (KeyboardInterrupt, SystemExit, asyncio.CancelledError)
OUTPUT_LIMIT = 4096  # bytes a reward may print per chunk of rows; the rest is counted and dropped
TRACEBACK_LIMIT = 8000  # characters of a failed load's traceback sent to the trainer (its end says why)


def main(argv: list[str]) -> None:
    """Entry point: `python -m retrain.reward.worker FD`, FD being this end of the socket."""
    # Ctrl-C in the terminal, and a scheduler's SIGTERM/SIGUSR1/SIGUSR2 (SLURM signals every process
    # of a job), are for the trainer: it finishes its step, checkpoints, then stops us.
    for number in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(number, signal.SIG_IGN)
    output = BoundedOutput(OUTPUT_LIMIT)
    try:
        serve(Connection(int(argv[0])), output)
    finally:
        output.close()


def serve(conn: Connection, output: BoundedOutput | None = None) -> None:
    """Runs until the parent sends None or goes away."""
    try:
        parent_sys_path, reward_blob, reward_name, concurrent, timeout_s = conn.recv()
    except EOFError:
        return
    sys.path[:] = parent_sys_path
    try:
        reward = pickle.loads(reward_blob)
    except BaseException:  # an import error in the plugin module, a missing sys.path entry, ...
        conn.send(("init_error", -1, traceback.format_exc()[-TRACEBACK_LIMIT:]))
        return
    conn.send(("ready", -1, None))
    # One loop for the worker's life, so an async reward may keep a connection pool across chunks.
    loop = asyncio.new_event_loop()
    try:
        while True:
            try:
                chunk = conn.recv()
            except EOFError:
                return
            if chunk is None:
                return
            if output is not None:
                output.new_chunk(reward_name)
            if concurrent:
                loop.run_until_complete(_score_concurrently(reward, reward_name, chunk, conn, timeout_s))
            else:
                for row in chunk:
                    conn.send(score_row(reward, reward_name, row, loop))
    finally:
        loop.close()


def score_row(
    reward: Callable[..., Any], reward_name: str, row: Row, loop: asyncio.AbstractEventLoop | None = None
) -> Message:
    """One row's verdict message (`loop` runs a coroutine a sync reward hands back; the scorer, scoring in its own
    process, passes none)."""
    index, response, reference, extra = row
    try:
        value = reward(response, reference, **extra)
        if inspect.isawaitable(value):  # a sync callable that hands back a coroutine
            if loop is None:  # the scorer's own process runs only synchronous built-ins (scorer.IN_PROCESS_REWARDS)
                raise TypeError("a reward scored in the trainer's process returned an awaitable")
            value = loop.run_until_complete(value)
    except NoVerdict as exc:
        return ("excluded", index, describe_exception(exc))
    except _PASS_THROUGH:
        raise
    except BaseException as exc:  # some libraries raise BaseException subclasses for their timeouts
        return ("error", index, describe_exception(exc))
    return _checked(value, reward_name, index)


async def _score_concurrently(
    reward: Callable[..., Any], reward_name: str, chunk: list[Row], conn: Connection, timeout_s: float
) -> None:
    """Async rewards (LLM judges, remote verifiers) wait on I/O: run a whole chunk at once."""

    async def one(row: Row) -> None:
        index, response, reference, extra = row
        try:
            value = reward(response, reference, **extra)
            if inspect.isawaitable(value):
                value = await asyncio.wait_for(value, timeout_s)
        except TimeoutError:
            conn.send(("timeout", index, f"no result after {timeout_s:g} s"))
            return
        except NoVerdict as exc:
            conn.send(("excluded", index, describe_exception(exc)))
            return
        except _PASS_THROUGH:
            raise
        except BaseException as exc:
            conn.send(("error", index, describe_exception(exc)))
            return
        conn.send(_checked(value, reward_name, index))

    await asyncio.gather(*(one(row) for row in chunk))


def _checked(value: Any, reward_name: str, index: int) -> Message:
    try:
        return ("ok", index, checked_reward_value(value, reward_name))
    except RewardOutputError as exc:
        return ("bad_output", index, str(exc))


class BoundedOutput:
    """Routes this process's stdout and stderr (fds 1 and 2) through pipes; threads pass at most `limit`
    bytes per chunk of rows on to the streams the worker was started with, and count what they drop."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._budget = limit
        self._dropped = 0
        self._reward_name = "?"
        self._targets = {fd: os.dup(fd) for fd in (1, 2)}  # the streams the worker was started with
        self._threads: list[threading.Thread] = []
        for fd, target in self._targets.items():
            read_end, write_end = os.pipe()
            os.dup2(write_end, fd)
            os.close(write_end)
            thread = threading.Thread(target=self._forward, args=(read_end, target), daemon=True)
            thread.start()
            self._threads.append(thread)

    def new_chunk(self, reward_name: str) -> None:
        """A new chunk may print `limit` bytes again; report what the previous ones dropped."""
        self._flush_python_streams()
        with self._lock:
            dropped, self._dropped, self._budget, self._reward_name = self._dropped, 0, self.limit, reward_name
        self._note(dropped)

    def close(self) -> None:
        """Give fds 1 and 2 back to the original streams (closing the pipes), pass on what is left."""
        self._flush_python_streams()
        for fd, target in self._targets.items():
            os.dup2(target, fd)
        for thread in self._threads:
            thread.join(timeout=1.0)
        self._note(self._dropped)

    def _forward(self, source: int, target: int) -> None:
        """Runs until the pipe closes, draining it even when the target is gone (a reward must never block)."""
        with os.fdopen(source, "rb", buffering=0) as pipe:
            while data := pipe.read(1 << 16):
                with self._lock:
                    passed = data[: self._budget]
                    self._budget -= len(passed)
                    self._dropped += len(data) - len(passed)
                if passed:
                    with contextlib.suppress(OSError):  # the trainer's console closed: what the reward prints is lost
                        os.write(target, passed)

    def _note(self, dropped: int) -> None:
        if not dropped:
            return
        note = (
            f"[retrain] reward {self._reward_name}: {dropped} bytes of its output dropped (a scoring worker "
            f"passes on {self.limit} bytes per batch of completions)\n"
        )
        with contextlib.suppress(OSError):
            os.write(self._targets[2], note.encode())

    @staticmethod
    def _flush_python_streams() -> None:
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                with contextlib.suppress(OSError, ValueError):  # a closed or broken stream: nothing to flush
                    stream.flush()


if __name__ == "__main__":
    main(sys.argv[1:])
