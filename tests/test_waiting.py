"""The main thread's waits on other threads run a signal's handler promptly, whichever thread the kernel
delivered the signal to (a plain `Future.result()` runs it only when the wait ends)."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ALL_COMPLETED, FIRST_COMPLETED, FIRST_EXCEPTION, CancelledError, Future
from contextlib import contextmanager
from typing import Any

import pytest

from retrain.waiting import SIGNAL_POLL_S, result_of, wait_responsively

GIVE_UP_S = 10.0  # an unresponsive wait ends only when this timer settles its future


def signalled_from_another_thread(after_s: float = 0.2) -> None:
    """SIGUSR1 delivered to a helper thread, as the kernel may deliver a process's Ctrl-C or SIGTERM."""
    threading.Timer(after_s, lambda: signal.pthread_kill(threading.get_ident(), signal.SIGUSR1)).start()


@contextmanager
def handled(handler: Callable[[], None]) -> Iterator[None]:
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: handler())
    try:
        yield
    finally:
        signal.signal(signal.SIGUSR1, previous)


@pytest.mark.parametrize(
    "wait_on",
    [result_of, lambda future: wait_responsively([future], FIRST_EXCEPTION)],
    ids=["result_of", "wait_responsively"],
)
def test_a_signal_taken_by_another_thread_runs_its_handler_while_the_main_thread_waits(wait_on) -> None:
    pending: Future[str] = Future()
    give_up = threading.Timer(GIVE_UP_S, lambda: pending.done() or pending.set_result("given up"))
    give_up.start()
    with handled(lambda: pending.done() or pending.set_result("handled")):
        started = time.perf_counter()
        signalled_from_another_thread()
        wait_on(pending)
        waited = time.perf_counter() - started
    give_up.cancel()
    assert pending.result() == "handled" and waited < GIVE_UP_S / 2


def settled(value: Any = None, error: BaseException | None = None) -> Future[Any]:
    future: Future[Any] = Future()
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)
    return future


def test_wait_responsively_returns_on_its_condition_as_wait_does() -> None:
    ok, failed, pending = settled(1), settled(error=ValueError("boom")), Future()
    cancelled: Future[Any] = Future()
    cancelled.cancel()
    assert wait_responsively([ok, pending], FIRST_COMPLETED) == ({ok}, {pending})
    assert wait_responsively([ok, failed, pending], FIRST_EXCEPTION) == ({ok, failed}, {pending})
    assert wait_responsively([ok, cancelled], ALL_COMPLETED) == ({ok, cancelled}, set())

    with pytest.raises(CancelledError):
        result_of(cancelled)  # at once, as Future.result() does

    threading.Timer(3 * SIGNAL_POLL_S, lambda: pending.set_result(2)).start()
    assert wait_responsively([ok, cancelled, pending], FIRST_EXCEPTION) == ({ok, cancelled, pending}, set())
    assert result_of(pending) == 2
    with pytest.raises(ValueError, match="boom"):
        result_of(failed)
