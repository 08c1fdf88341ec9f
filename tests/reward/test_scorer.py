"""The parallel scorer with real worker processes and real (good and buggy) reward plugins."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import statistics
import sys
import time
import types
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate

from retrain.config import compose
from retrain.errors import ConfigError, RewardFailureError, RewardOutputError, RewardWorkerError
from retrain.plugins import plugin_name
from retrain.reward import scorer as scorer_module
from retrain.reward.checks import MESSAGE_LIMIT
from retrain.reward.match import match_reward
from retrain.reward.scorer import RewardScorer, fill_excluded, in_process_form, is_async_reward
from retrain.run import build_part
from retrain.types import Example
from tests.plugins import reward_plugins as plugins


def examples(references: list[str], **extra: object) -> list[Example]:
    return [Example(prompt=f"q{n}", reference=ref, id=str(n), extra=dict(extra)) for n, ref in enumerate(references)]


def child_processes() -> set[int]:
    """This process's children, from /proc (Linux): a scorer's workers show up here."""
    children = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):  # a process that ended while we looked
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            if parent == os.getpid():
                children.add(int(stat.parent.name))
    return children


def test_rows_come_back_aligned_and_match_in_process_scores() -> None:
    references = [str(n % 7) for n in range(64)]
    responses = [f"so \\boxed{{{n % 5}}}" if n % 3 else "no box" for n in range(64)]
    expected = [match_reward(r, ref) for r, ref in zip(responses, references)]
    # a plugin (the workers score it) and the built-in match (scored in this process) agree row by row
    for reward in (plugins.ScaledMatchReward(), match_reward):
        with RewardScorer(reward, timeout_s=5, workers=2) as scorer:
            result = scorer.score(responses, examples(references))
        assert result.rewards.dtype == torch.float32 and result.rewards.shape == (64,)
        assert result.rewards.tolist() == expected
        assert (result.errors, result.timeouts, result.failures) == (0, 0, {})
    assert 0 < sum(expected) < 64


@dataclasses.dataclass
class UnhashableReward:
    """A dataclass reward: `eq=True` makes its instances unhashable."""

    scale: float = 1.0

    def __call__(self, response: str, reference: str, **extra: object) -> float:
        return self.scale


def test_only_known_pure_built_ins_score_in_process() -> None:
    configured = instantiate(compose(["reward=match"]).reward)  # Hydra's partial, which re-authorizes every call
    for reward in (match_reward, functools.partial(match_reward), configured):
        local = in_process_form(reward)
        assert type(local) is functools.partial and local.func is match_reward
    assert in_process_form(functools.partial(functools.partial(match_reward, "\\boxed{1}"), "1"))() == 1.0
    math = build_part(compose(["reward=math"]), "reward")
    for reward in (plugins.my_reward, plugins.ScaledMatchReward(), math, UnhashableReward()):
        assert in_process_form(reward) is None
    before = child_processes()
    with RewardScorer(configured, name="retrain.reward.match.match_reward", workers=2) as scorer:
        assert child_processes() == before
        assert scorer.score(["\\boxed{7}", "7"], examples(["7", "7"])).rewards.tolist() == [1.0, 0.0]
    with RewardScorer(plugins.my_reward, workers=2):
        assert len(child_processes() - before) == 2


def test_in_process_rewards_get_the_verdicts_workers_give(monkeypatch: pytest.MonkeyPatch) -> None:
    """Scored in this process, a reward's failures still count per row instead of ending the step."""
    monkeypatch.setattr(scorer_module, "IN_PROCESS_REWARDS", (plugins.flaky_reward, plugins.undecided_reward))
    before = child_processes()
    with RewardScorer(plugins.flaky_reward, workers=2) as scorer:
        assert child_processes() == before
        result = scorer.score(["fine", "boom", "fine", "stall"], examples(["x"] * 4))
    assert result.rewards.tolist() == [1.0, 0.0, 1.0, 0.0]
    assert result.failures == {1: "RuntimeError: boom", 3: "LibraryTimeout: gave up"}
    with RewardScorer(plugins.undecided_reward, workers=1, max_failing_steps=2) as scorer:
        assert scorer.score(["undecided", "x"], examples(["x"] * 2)).excluded == {
            0: "NoVerdict: the verifier is unavailable"
        }
    monkeypatch.setattr(scorer_module, "IN_PROCESS_REWARDS", (plugins.nan_reward,))
    with RewardScorer(plugins.nan_reward, workers=1) as scorer, pytest.raises(RewardOutputError, match="row 1"):
        scorer.score(["fine", "nan"], examples(["x"] * 2))


def test_raising_rows_score_zero_and_are_counted() -> None:
    responses = ["fine", "boom", "fine", "stall", "fine"]
    with RewardScorer(plugins.flaky_reward, timeout_s=5, workers=2) as scorer:
        result = scorer.score(responses, examples(["x"] * 5))
    assert result.rewards.tolist() == [1.0, 0.0, 1.0, 0.0, 1.0]
    assert (result.errors, result.timeouts) == (2, 0)
    assert result.failures == {1: "RuntimeError: boom", 3: "LibraryTimeout: gave up"}


def test_a_hung_reward_is_bounded_by_the_timeout_and_the_pool_recovers() -> None:
    responses = ["ok", "hang", "ok", "ok", "hang", "ok", "ok", "ok"]
    with RewardScorer(plugins.hanging_reward, timeout_s=1.0, workers=2) as scorer:
        started = time.monotonic()
        result = scorer.score(responses, examples(["x"] * 8))
        elapsed = time.monotonic() - started
        assert result.rewards.tolist() == [1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0]
        assert (result.errors, result.timeouts) == (2, 2)
        assert "no result after 1 s" in result.failures[1]
        assert elapsed < 6.0  # two hung rows on two workers: ~1-2 s, not an hour
        # The next step finds a full pool of live workers.
        again = scorer.score(["ok"] * 16, examples(["x"] * 16))
        assert again.rewards.tolist() == [1.0] * 16 and again.errors == 0


def test_async_rewards_run_concurrently_and_time_out_per_row() -> None:
    assert is_async_reward(plugins.async_reward)
    responses = [f"answer {n}" for n in range(31)] + ["hang"]
    references = [str(n) for n in range(32)]
    with RewardScorer(plugins.async_reward, timeout_s=1.5, workers=2) as scorer:
        started = time.monotonic()
        result = scorer.score(responses, examples(references))
        elapsed = time.monotonic() - started
    assert result.rewards.tolist() == [1.0] * 31 + [0.0]
    assert (result.errors, result.timeouts) == (1, 1)
    # 31 calls of 0.2 s in sequence would take 6 s; concurrently they take one timeout at most.
    assert elapsed < 4.0


def test_an_async_reward_that_blocks_its_event_loop_is_killed() -> None:
    # The worker's per-row timer cannot fire on a blocked loop: the parent kills the worker after
    # timeout_s plus a grace period, and every row of its chunk counts as timed out.
    with RewardScorer(plugins.blocking_async_reward, timeout_s=0.5, workers=2) as scorer:
        started = time.monotonic()
        result = scorer.score(["ok", "hang", "ok", "ok"], examples(["x"] * 4))
        assert time.monotonic() - started < 8.0
        assert result.rewards.tolist() == [0.0, 0.0, 1.0, 1.0]  # rows 0-1 shared the blocked worker
        assert (result.errors, result.timeouts) == (2, 2)
        assert scorer.score(["ok"] * 4, examples(["x"] * 4)).rewards.tolist() == [1.0] * 4


def test_a_crashed_worker_costs_one_row_and_is_replaced() -> None:
    responses = ["ok", "ok", "crash", "ok", "ok", "ok"]
    with RewardScorer(plugins.crashing_reward, timeout_s=5, workers=2) as scorer:
        result = scorer.score(responses, examples(["x"] * 6))
        assert result.rewards.tolist() == [1.0, 1.0, 0.0, 1.0, 1.0, 1.0]
        assert (result.errors, result.timeouts) == (1, 0)
        assert "exit code 3" in result.failures[2]
        assert scorer.score(["ok"] * 4, examples(["x"] * 4)).rewards.tolist() == [1.0] * 4


@pytest.mark.parametrize(
    ("reward", "trigger", "shown"),
    [
        (plugins.nan_reward, "nan", "returned nan"),
        (plugins.list_reward, "list", "a list of 2 values ([1.0, 0.0])"),
        (plugins.string_reward, "string", "'1.0' of type str"),
    ],
)
def test_a_wrong_output_is_a_clear_error_naming_reward_and_value(reward, trigger: str, shown: str) -> None:
    with RewardScorer(reward, timeout_s=5, workers=2) as scorer:
        with pytest.raises(RewardOutputError) as caught:
            scorer.score(["fine", trigger, "fine"], examples(["x"] * 3))
        message = str(caught.value)
        assert f"tests.plugins.reward_plugins.{reward.__name__}" in message
        assert shown in message and "row 1" in message
        # A bug in the reward stops the step, but does not poison the scorer.
        assert scorer.score(["fine"] * 3, examples(["x"] * 3)).rewards.tolist() == [1.0] * 3


@pytest.mark.parametrize(
    ("trigger", "shown"), [("int", "returned an int of about 400 digits"), ("float", r"returned 1e\+308")]
)
def test_a_reward_past_float32_is_a_clear_error_not_a_dead_worker(trigger: str, shown: str) -> None:
    name = "tests.plugins.reward_plugins.overflowing_reward"
    with (
        RewardScorer(plugins.overflowing_reward, timeout_s=5, workers=1) as scorer,
        pytest.raises(RewardOutputError, match=f"reward {name} {shown}"),
    ):
        scorer.score(["fine", trigger], examples(["x"] * 2))


def test_what_a_reward_prints_and_raises_is_bounded(capfd: pytest.CaptureFixture[str]) -> None:
    with RewardScorer(plugins.verbose_reward, timeout_s=10, workers=1) as scorer:
        result = scorer.score(["fine", "boom", "fine", "fine"], examples(["x"] * 4))
    assert result.rewards.tolist() == [1.0, 0.0, 1.0, 1.0]
    assert result.failures[1].startswith("RuntimeError: eee") and len(result.failures[1]) < MESSAGE_LIMIT + 50
    printed = capfd.readouterr()
    assert len(printed.out) + len(printed.err) < 64 * 1024  # of 8 MB printed
    assert "bytes of its output dropped" in printed.err


def test_rows_without_a_verdict_are_excluded_not_scored() -> None:
    with RewardScorer(plugins.undecided_reward, timeout_s=5, workers=2) as scorer:
        result = scorer.score(["x", "undecided", "y", "undecided x"], examples(["x"] * 4))
    assert (result.errors, sorted(result.excluded)) == (0, [1, 3])
    assert result.excluded[1] == "NoVerdict: the verifier is unavailable"
    assert result.excluded_mask().tolist() == [False, True, False, True]


def test_excluded_rows_take_the_mean_of_their_group_so_they_move_no_advantage() -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    excluded = torch.tensor([[False, False, True, False], [True, True, False, False], [True] * 4])
    filled = fill_excluded(rewards, excluded)
    torch.testing.assert_close(filled, torch.tensor([[1.0, 0.0, 1 / 3, 0.0], [0.5, 0.5, 1.0, 0.0], [0.0] * 4]))
    kept = rewards[0, [0, 1, 3]]
    assert filled[0].mean() == pytest.approx(kept.mean())  # the group's baseline is that of its scored rows


def test_a_reward_that_scores_nothing_for_several_steps_stops_the_run() -> None:
    with RewardScorer(plugins.undecided_reward, timeout_s=5, workers=1, max_failing_steps=2) as scorer:
        scorer.score(["undecided"] * 2, examples(["x"] * 2))
        scorer.score(["x", "undecided"], examples(["x"] * 2))  # one row scored: the count starts over
        scorer.score(["undecided"] * 2, examples(["x"] * 2))
        with pytest.raises(
            RewardFailureError,
            match=r"scored none of the completions of 2 steps in a row.*the verifier is unavailable.*"
            r"scoring.max_failing_steps=0",
        ):
            scorer.score(["undecided"] * 2, examples(["x"] * 2))
    with RewardScorer(plugins.flaky_reward, timeout_s=5, workers=1, max_failing_steps=0) as scorer:
        for _ in range(4):
            assert scorer.score(["boom"] * 2, examples(["x"] * 2)).errors == 2


@pytest.mark.parametrize(("limit", "recycled"), [(100, True), (0, False)])
def test_a_worker_past_its_memory_limit_is_replaced(limit: int, recycled: bool) -> None:
    with RewardScorer(plugins.memory_hog_reward, timeout_s=10, workers=1, max_worker_rss_mb=limit) as scorer:
        # each row scores the worker's pid; one worker, one row per chunk: a new chunk may find a new worker
        first = scorer.score(["fine", "hog", "fine"], examples(["x"] * 3)).rewards.tolist()
        second = scorer.score(["hog", "fine"], examples(["x"] * 2)).rewards.tolist()
    pids = [*first, *second]
    if recycled:  # a worker that held on to 128 MB ("hog") scores nothing more
        assert pids[0] == pids[1] != pids[2] == pids[3] != pids[4]
    else:
        assert len(set(pids)) == 1


def test_extra_reaches_the_reward_as_keyword_arguments() -> None:
    rows = examples(["x", "x"], subject="algebra") + examples(["x"], subject="geometry")
    with RewardScorer(plugins.subject_reward, timeout_s=5, workers=2) as scorer:
        assert scorer.score(["a", "b", "c"], rows).rewards.tolist() == [1.0, 1.0, 0.0]


def test_plugins_swap_in_from_the_command_line() -> None:
    function_cfg = compose(["reward._target_=tests.plugins.reward_plugins.my_reward"])
    class_cfg = compose(
        [
            "reward._target_=tests.plugins.reward_plugins.ScaledMatchReward",
            "reward._partial_=false",
            "+reward.scale=0.5",
        ]
    )
    responses = ["it is 12", "\\boxed{12}", "nothing"]
    with RewardScorer(instantiate(function_cfg.reward), name=function_cfg.reward._target_, workers=2) as scorer:
        assert scorer.score(responses, examples(["12"] * 3)).rewards.tolist() == [1.0, 1.0, 0.0]
    with RewardScorer(instantiate(class_cfg.reward), workers=2) as scorer:
        assert scorer.name == "tests.plugins.reward_plugins.ScaledMatchReward"
        assert scorer.score(responses, examples(["12"] * 3)).rewards.tolist() == [0.0, 0.5, 0.0]


def test_a_class_reward_left_partial_is_refused_naming_the_fix() -> None:
    partial = instantiate(compose(["reward._target_=tests.plugins.reward_plugins.ScaledMatchReward"]).reward)
    with pytest.raises(ConfigError, match="ScaledMatchReward is a class: set reward._partial_=false"):
        RewardScorer(partial, workers=1)


def test_unpicklable_rewards_are_refused_before_any_worker_starts() -> None:
    with pytest.raises(ConfigError, match="cannot be sent to the scoring worker processes"):
        RewardScorer(lambda response, reference, **extra: 1.0, name="my_lambda", workers=1)


def test_a_reward_the_workers_cannot_import_fails_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    # A module that exists only in this process: the reward pickles by name, workers cannot import it.
    module = types.ModuleType("only_in_the_parent")
    exec("def reward(response, reference, **extra):\n    return 1.0", module.__dict__)
    monkeypatch.setitem(sys.modules, "only_in_the_parent", module)
    with pytest.raises(RewardWorkerError, match="could not load reward only_in_the_parent.reward"):
        RewardScorer(module.reward, workers=1)


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"timeout_s": 0}, "scoring.timeout_s"),
        ({"workers": -1}, "scoring.workers"),
        ({"max_failing_steps": -1}, "scoring.max_failing_steps"),
        ({"max_worker_rss_mb": -1}, "scoring.max_worker_rss_mb"),
    ],
)
def test_bad_scoring_settings_name_their_key(kwargs: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        RewardScorer(match_reward, **kwargs)


def test_misaligned_rows_and_closed_scorers_are_refused() -> None:
    scorer = RewardScorer(match_reward, workers=1)
    with pytest.raises(ValueError, match="row-aligned"):
        scorer.score(["a", "b"], examples(["1"]))
    assert scorer.score([], []).rewards.shape == (0,)
    scorer.close()
    scorer.close()
    with pytest.raises(RuntimeError, match="closed"):
        scorer.score(["a"], examples(["1"]))


def test_rewards_are_named_by_the_one_plugin_naming_helper() -> None:
    assert plugin_name(match_reward) == "retrain.reward.match.match_reward"
    assert (
        plugin_name(functools.partial(functools.partial(plugins.my_reward))) == "tests.plugins.reward_plugins.my_reward"
    )
    assert plugin_name(plugins.ScaledMatchReward()) == "tests.plugins.reward_plugins.ScaledMatchReward"
    assert (
        plugin_name(plugins.ScaledMatchReward().__call__) == "tests.plugins.reward_plugins.ScaledMatchReward.__call__"
    )
    with RewardScorer(plugins.ScaledMatchReward(), workers=1) as scorer:
        assert scorer.name == "tests.plugins.reward_plugins.ScaledMatchReward"


@pytest.mark.parametrize(
    ("reward", "bound_s"),
    [
        (plugins.ScaledMatchReward(), 0.1),  # a few ms of IPC, small next to a ~0.1 s demo step (~5 ms measured)
        (match_reward, 0.02),  # in this process: ~1 ms
    ],
)
def test_overhead_for_a_cheap_reward_stays_small(reward: object, bound_s: float) -> None:
    """256 completions of a cheap reward, in the workers or (the built-in match) in this process."""
    references = [str(n) for n in range(256)]
    responses = [f"\\boxed{{{n}}}" for n in range(256)]
    with RewardScorer(reward, timeout_s=5, workers=2) as scorer:
        timings = []
        for _ in range(5):
            started = time.perf_counter()
            result = scorer.score(responses, examples(references))
            timings.append(time.perf_counter() - started)
    assert result.rewards.sum().item() == 256
    assert statistics.median(timings) < bound_s


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie waiting for its reaper counts as ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def helpers_alive(pid_dir: Path, wait_s: float = 5.0) -> list[int]:
    pids = [int(path.stem) for path in pid_dir.glob("*.pid")]
    deadline = time.monotonic() + wait_s
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [pid for pid in pids if alive(pid)]


@pytest.mark.parametrize("responses", [["ok", "ok"], ["ok", "hang"]])
def test_processes_a_reward_starts_end_with_its_worker(tmp_path: Path, responses: list[str]) -> None:
    """A reward's forked children are killed with its worker: on a timeout, and when the scorer closes."""
    with RewardScorer(plugins.forking_reward, timeout_s=1.0, workers=1) as scorer:
        result = scorer.score(responses, examples(["x"] * 2, pid_dir=str(tmp_path)))
        assert result.timeouts == responses.count("hang")
        if "hang" in responses:  # the hung worker was killed: the helpers it started are gone too
            assert len(list(tmp_path.glob("*.pid"))) == 2 and helpers_alive(tmp_path) == []
    assert len(list(tmp_path.glob("*.pid"))) == 2
    assert helpers_alive(tmp_path) == []
