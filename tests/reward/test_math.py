"""`reward=math`: math-verify equivalence, cached reference parses, bounded work (docs/rewards.md)."""

from __future__ import annotations

import gc
import pickle
import signal
import sys
import threading
import time

import pytest

from retrain.config import compose
from retrain.errors import ConfigError
from retrain.reward.config import MathRewardConfig
from retrain.reward.math import ALARM_REPEAT_S, MathReward, _within
from retrain.reward.scorer import RewardScorer
from retrain.run import build_part
from retrain.types import Example

# Two expressions that math-verify cannot compare within a second (sympy expands the power).
SLOW_RESPONSE, SLOW_REFERENCE = "\\boxed{(x+1)^{100000}}", "x^{100000}"


@pytest.fixture(scope="module")
def reward() -> MathReward:
    return MathReward(MathRewardConfig())


@pytest.mark.parametrize(
    ("response", "reference"),
    [
        ("so \\boxed{0.5}", "\\frac{1}{2}"),
        ("\\boxed{\\dfrac{1}{2}}", "\\frac12"),
        ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}"),
        ("\\boxed{\\{2, 1\\}}", "\\{1,2\\}"),
        ("\\boxed{x = 3}", "3"),
        ("\\boxed{10,000}", "10000"),
        ("first \\boxed{7}, finally \\boxed{\\frac{\\pi}{2}}", "\\pi/2"),
    ],
)
def test_equivalent_answers_score_one(reward: MathReward, response: str, reference: str) -> None:
    assert reward(response, reference) == 1.0


@pytest.mark.parametrize(
    ("response", "reference"),
    [
        ("\\boxed{0.51}", "\\frac{1}{2}"),
        ("\\boxed{\\frac{1}{2}} wait, \\boxed{3}", "\\frac{1}{2}"),  # only the last box counts
        ("the answer is 1/2", "\\frac{1}{2}"),  # no box, no verdict
        ("\\boxed{}", "1"),
        ("\\boxed{%$#@}", "1"),  # garbage is a wrong answer, not a failure
        ("\\boxed{1}", ""),  # an empty reference never matches
    ],
)
def test_other_answers_score_zero(reward: MathReward, response: str, reference: str) -> None:
    assert reward(response, reference) == 0.0


def test_the_reference_is_parsed_once_per_distinct_string() -> None:
    reward = MathReward(MathRewardConfig(cache_size=2))
    for _ in range(8):
        reward("\\boxed{1/2}", "\\frac{1}{2}")
    info = reward._parsed_reference.cache_info()
    assert (info.misses, info.hits) == (1, 7)
    for reference in ["1", "2", "3"]:
        reward("\\boxed{1}", reference)
    assert reward._parsed_reference.cache_info().currsize == 2  # bounded


def test_it_pickles_into_workers_with_an_empty_cache(reward: MathReward) -> None:
    reward("\\boxed{1}", "1")
    copy = pickle.loads(pickle.dumps(reward))
    assert copy._parsed_reference.cache_info().currsize == 0
    assert copy("\\boxed{0.5}", "\\frac{1}{2}") == 1.0


def test_it_works_off_the_main_thread_without_signals(reward: MathReward) -> None:
    results: list[float] = []
    worker = threading.Thread(target=lambda: results.append(reward("\\boxed{0.5}", "\\frac{1}{2}")))
    worker.start()
    worker.join(60)
    assert results == [1.0]


def test_a_comparison_past_its_bound_raises_and_the_scorer_counts_it() -> None:
    reward = MathReward(MathRewardConfig(verify_timeout_s=1))
    with pytest.raises(TimeoutError, match="could not compare within 1 s"):
        reward(SLOW_RESPONSE, SLOW_REFERENCE)
    rows = [Example("q", SLOW_REFERENCE, "slow"), Example("q", "\\frac{1}{2}", "fine")]
    with RewardScorer(reward, timeout_s=20, workers=2) as scorer:
        result = scorer.score([SLOW_RESPONSE, "\\boxed{0.5}"], rows)
    assert result.rewards.tolist() == [0.0, 1.0]
    assert (result.errors, result.timeouts) == (1, 0)  # math-verify's own bound fired, not the scorer's
    assert result.failures[0] == "TimeoutError: math-verify could not compare within 1 s"


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the alarm the callback swallows
def test_an_alarm_lost_in_a_gc_callback_is_followed_by_another(monkeypatch) -> None:
    """The window opened on purpose: the first alarm lands in a garbage-collector callback, which swallows it (seen
    in CI, behind a comparison that then ran for ten minutes); the next one stops the call. The swallowed alarm is
    reported by the interpreter's own hook, as in a run: pytest's formats it in Python, slowly on a loaded machine,
    and the next alarm landed inside it once (a RuntimeError of pytest's, not of the call)."""
    monkeypatch.setattr(sys, "unraisablehook", sys.__unraisablehook__)

    slept: list[float] = []
    collected: list[float] = []

    def slow_callback(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            began = time.monotonic()
            try:
                time.sleep(1.5)  # the 1 s alarm lands in here
            finally:
                slept.append(time.monotonic() - began)

    def endless() -> None:
        gc.callbacks.append(slow_callback)
        try:
            gc.collect()  # in a worker that imported torch and vLLM, a full collection itself takes a while
        finally:
            gc.callbacks.remove(slow_callback)
        collected.append(time.monotonic())
        while True:
            time.sleep(0.01)

    handler = signal.getsignal(signal.SIGALRM)  # pytest-timeout's, with its alarm set: the next test restores it
    with pytest.raises(TimeoutError, match="^stopped$"):
        _within(1, endless, "stopped")
    assert slept[0] < 1.5  # the first alarm cut the callback short, which swallowed it
    assert time.monotonic() - collected[0] < 10 * ALARM_REPEAT_S  # a later one stopped the endless call
    assert _within(1, lambda: 1, "stopped") == 1
    assert signal.getsignal(signal.SIGALRM) is handler


def test_a_timer_the_caller_set_keeps_its_deadline() -> None:
    """pytest-timeout's alarm, or a user's own, set before the reward runs, still fires when it was due."""
    fired: list[float] = []
    previous = signal.signal(signal.SIGALRM, lambda signum, frame: fired.append(time.monotonic()))
    try:
        started = time.monotonic()
        signal.setitimer(signal.ITIMER_REAL, 1.5)
        assert _within(5, lambda: time.sleep(0.5), "stopped") is None
        left, repeat = signal.getitimer(signal.ITIMER_REAL)
        assert 0 < left <= 1.0 and repeat == 0  # what was left of the 1.5 s
        while not fired and time.monotonic() - started < 5:
            time.sleep(0.01)
        assert len(fired) == 1 and 1.45 < fired[0] - started < 2.5  # due at 1.5 s (a loaded machine may be late)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_reward_math_composes_and_instantiates() -> None:
    cfg = compose(["reward=math", "reward.verify_timeout_s=2"])
    reward = build_part(cfg, "reward")
    assert isinstance(reward, MathReward) and reward.verify_timeout_s == 2
    assert reward("\\boxed{0.5}", "1/2") == 1.0


@pytest.mark.parametrize("key", ["parse_timeout_s", "verify_timeout_s", "cache_size"])
def test_bad_settings_name_their_key(key: str) -> None:
    with pytest.raises(ConfigError, match=f"reward.{key}"):
        MathReward(MathRewardConfig(**{key: 0}))
