"""`reward=math`: symbolic equivalence of the last boxed answer and the reference (math-verify).

Failures are not verdicts: a parse or comparison that times out or breaks raises, so the scorer
scores the completion 0.0 *and* counts it in `reward/errors`. A completion with no boxed answer,
or whose answer is simply different, is a plain 0.0.

math-verify's work is bounded by SIGALRM, which only works in a process's main thread. The scorer's
worker processes run rewards in their main thread, so the bounds apply there; called from any other
thread, this reward runs math-verify without them and relies on the scorer's per-completion timeout.

An alarm that fires while the interpreter runs a garbage-collector callback is swallowed there
(Python reports it as "unraisable" and the work goes on: a comparison of huge powers then ran for
ten minutes). math-verify's own alarm fires once, so this reward sets its own, which repeats every
ALARM_REPEAT_S until the bounded call has ended.
"""

from __future__ import annotations

import functools
import signal
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from math_verify import LatexExtractionConfig, parse, verify

from retrain.plugins import built_in
from retrain.reward.config import MathRewardConfig
from retrain.reward.extract import last_boxed
from retrain.settings_object import takes_settings

_EXTRACTION = (LatexExtractionConfig(),)

_T = TypeVar("_T")


ALARM_REPEAT_S = 0.1  # after an alarm lost in a gc callback, the next one


class _Expired(BaseException):
    """The alarm, raised in the bounded call: a BaseException, so no `except Exception` in math-verify or sympy
    takes it for a failed parse."""


def _within(bound_s: int, call: Callable[[], _T], failure: str) -> _T:
    """`call()` stopped by an alarm `bound_s` after it starts (main thread only; no bound elsewhere): TimeoutError."""
    if threading.current_thread() is not threading.main_thread():
        return call()
    armed = True

    def expire(signum: int, frame: Any) -> None:
        if armed:
            raise _Expired

    previous = signal.signal(signal.SIGALRM, expire)
    started = time.monotonic()
    outer_delay, outer_repeat = signal.setitimer(signal.ITIMER_REAL, bound_s, ALARM_REPEAT_S)
    try:
        try:
            return call()
        finally:
            armed = False  # an alarm already on its way lands here harmlessly
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
            if outer_delay > 0:  # a timer the caller had set (pytest-timeout's, say) keeps its deadline
                left = outer_delay - (time.monotonic() - started)
                signal.setitimer(signal.ITIMER_REAL, max(left, 1e-3), outer_repeat)
    except _Expired:
        raise TimeoutError(failure) from None


@built_in
@takes_settings(MathRewardConfig)
class MathReward:
    """Callable reward; configured by instance attributes, so it pickles into scoring workers.

    The parsed reference is cached per distinct reference string (a bounded LRU, one per worker):
    every completion of a group shares its reference, so it is parsed once, not G times.
    """

    def __init__(self, config: MathRewardConfig) -> None:
        self.parse_timeout_s = int(config.parse_timeout_s)
        self.verify_timeout_s = int(config.verify_timeout_s)
        self.cache_size = int(config.cache_size)
        self._parsed_reference = functools.lru_cache(maxsize=self.cache_size)(self._parse_reference)

    def __call__(self, response: str, reference: str, **extra: Any) -> float:
        if not reference.strip():
            return 0.0
        answer = last_boxed(response)
        if answer is None or not answer.strip():
            return 0.0
        gold = self._parsed_reference(reference)
        predicted = self._parse(answer)
        if not predicted:
            return 0.0
        equal = _within(
            self.verify_timeout_s,
            lambda: verify(gold, predicted, timeout_seconds=None, raise_on_error=True),
            f"math-verify could not compare within {self.verify_timeout_s} s",
        )
        return 1.0 if equal else 0.0

    def _parse_reference(self, reference: str) -> list[Any]:
        parsed = self._parse(reference)
        if not parsed:
            raise ValueError(f"math-verify could not parse the reference {reference!r}")
        return parsed

    def _parse(self, answer: str) -> list[Any]:
        return _within(
            self.parse_timeout_s,
            lambda: parse(
                f"\\boxed{{{answer}}}", extraction_config=_EXTRACTION, parsing_timeout=None, raise_on_error=True
            ),
            f"math-verify could not parse {answer[:80]!r} within {self.parse_timeout_s} s",
        )

    # The cache holds sympy objects and a bound method: rebuild it, empty, wherever we are unpickled.
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_parsed_reference"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._parsed_reference = functools.lru_cache(maxsize=self.cache_size)(self._parse_reference)
