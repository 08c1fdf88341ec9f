"""What runs inside a scoring worker process: load the reward once, then score chunks of rows.

A worker is a fresh interpreter (`python -m retrain.reward.worker FD`) talking over a socket: no
fork of a trainer that holds CUDA contexts and thread pools, and no re-import of the user's main
module. Its first message from the parent is the setup: the parent's sys.path (so plugins import
the same way), the pickled reward, the reward's name, whether to run rows concurrently, the timeout.

Messages are `(kind, row, payload)` tuples. The parent then sends a chunk (a list of
`(row, response, reference, extra)`) or None to stop; the worker answers `("ready", -1, None)` once
the reward is loaded (or `("init_error", -1, traceback)`), then one message per row, as soon as that
row is done: `("ok", row, value)`, `("error", row, why)`, `("timeout", row, why)` (async rewards
only; the parent times sync rows itself) or `("bad_output", row, message)`.

Rewards run in the worker's main thread, so libraries that time themselves with signals
(math-verify) work here, and a reward that never returns can be killed with its process.
"""

from __future__ import annotations

import asyncio
import inspect
import pickle
import signal
import sys
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from retrain.errors import RewardOutputError
from retrain.reward.checks import checked_reward_value

Row = tuple[int, str, str, dict[str, Any]]
Message = tuple[str, int, Any]
# What a reward may not swallow into a score of 0: the worker's own exit and cancellation.
_PASS_THROUGH = (KeyboardInterrupt, SystemExit, asyncio.CancelledError)


def main(argv: list[str]) -> None:
    """Entry point: `python -m retrain.reward.worker FD`, FD being this end of the socket."""
    # Ctrl-C in the terminal, and a scheduler's SIGTERM/SIGUSR1/SIGUSR2 (SLURM signals every process
    # of a job), are for the trainer: it finishes its step, checkpoints, then stops us.
    for number in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(number, signal.SIG_IGN)
    serve(Connection(int(argv[0])))


def serve(conn: Connection) -> None:
    """Runs until the parent sends None or goes away."""
    try:
        parent_sys_path, reward_blob, reward_name, concurrent, timeout_s = conn.recv()
    except EOFError:
        return
    sys.path[:] = parent_sys_path
    try:
        reward = pickle.loads(reward_blob)
    except BaseException:  # an import error in the plugin module, a missing sys.path entry, ...
        conn.send(("init_error", -1, traceback.format_exc()))
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
            if concurrent:
                loop.run_until_complete(_score_concurrently(reward, reward_name, chunk, conn, timeout_s))
            else:
                for row in chunk:
                    conn.send(_score_one(reward, reward_name, row, loop))
    finally:
        loop.close()


def _score_one(reward: Callable[..., Any], reward_name: str, row: Row, loop: asyncio.AbstractEventLoop) -> Message:
    index, response, reference, extra = row
    try:
        value = reward(response, reference, **extra)
        if inspect.isawaitable(value):  # a sync callable that hands back a coroutine
            value = loop.run_until_complete(value)
    except _PASS_THROUGH:
        raise
    except BaseException as exc:  # some libraries raise BaseException subclasses for their timeouts
        return ("error", index, f"{type(exc).__name__}: {exc}")
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
        except _PASS_THROUGH:
            raise
        except BaseException as exc:
            conn.send(("error", index, f"{type(exc).__name__}: {exc}"))
            return
        conn.send(_checked(value, reward_name, index))

    await asyncio.gather(*(one(row) for row in chunk))


def _checked(value: Any, reward_name: str, index: int) -> Message:
    try:
        return ("ok", index, checked_reward_value(value, reward_name))
    except RewardOutputError as exc:
        return ("bad_output", index, str(exc))


if __name__ == "__main__":
    main(sys.argv[1:])
