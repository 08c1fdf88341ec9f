"""Waits on other threads that keep the main thread's signal handlers running.

Python runs signal handlers in the main thread only, between bytecodes, and the kernel may deliver a
process's signal (Ctrl-C, SIGTERM, a cluster's pre-emption) to any of its threads: the HTTP loop's, a
pool's, OpenMP's. A main thread blocked on a lock without a timeout is then not woken, and runs the
handler only when its wait ends: a Ctrl-C during a stuck request would wait that request out, however
long its timeout. These waits wake every SIGNAL_POLL_S, so a handler runs within that, whichever thread
the signal landed on.
"""

from __future__ import annotations

from collections.abc import Collection
from concurrent.futures import ALL_COMPLETED, FIRST_COMPLETED, FIRST_EXCEPTION, Future, wait
from typing import Any, TypeVar

T = TypeVar("T")

SIGNAL_POLL_S = 0.1  # the longest a signal handler waits while the main thread waits on another thread


def wait_responsively(
    futures: Collection[Future[Any]], return_when: str = ALL_COMPLETED
) -> tuple[set[Future[Any]], set[Future[Any]]]:
    """`concurrent.futures.wait(futures, return_when=...)` without a timeout, waking for signal handlers. A cancelled
    future is done at once, as `Future.done()` says and its `result()` raises (`wait` itself waits until an
    executor has noticed the cancellation, which a future nobody runs never gets)."""
    while True:
        done = {future for future in futures if future.done()}
        pending = set(futures) - done
        failed = any(not future.cancelled() and future.exception() is not None for future in done)
        if not pending or (return_when == FIRST_COMPLETED and done) or (return_when == FIRST_EXCEPTION and failed):
            return done, pending
        wait(pending, SIGNAL_POLL_S, return_when)


def result_of(future: Future[T]) -> T:
    """`future.result()`, waking for signal handlers."""
    wait_responsively([future])
    return future.result()
