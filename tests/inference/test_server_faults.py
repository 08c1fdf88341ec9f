"""Faults while sampling ahead (training.max_staleness k = 2, docs/async.md#faults) against a server engine
(inference=sglang on a loopback server serving the real tiny model): a server that dies or stalls while a batch
ahead is sampled ends the run with one error naming it, within inference.timeout_s and max_retries, and the run
resumes from its last checkpoint to the uninterrupted run's metrics; a reward that hangs on the producer's thread
is bounded by scoring.timeout_s as at k = 0; a straggling request does not stall the trainer."""

from __future__ import annotations

import logging
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from retrain.housekeeping.rundir import Checkpoint, RunDir
from retrain.inference.http import HttpError
from retrain.training.sampled_ahead import load_sampled_ahead
from tests.conftest import read_metrics, without_timing
from tests.inference.fake_servers import ServedModel
from tests.inference.loopback import Route
from tests.inference.test_server_training import is_probe, sglang_server, train, trainer_of
from tests.test_split_mode import stopped_after

TIMEOUT_S = 5  # every request's bound; a sampling request of the tiny model takes well under a second
# k = 2, a checkpoint before step 3: batches 3, 4 and 5 are sampled with step 3's weights. Batch 3 waits for the
# checkpoint (lag 0); the producer starts batch 4 as soon as the trainer takes batch 3, so the server fails on a batch
# ahead while the trainer trains step 3 (its sync's freshness probe may meet the fault first: either names the url)
AHEAD = [
    "training.max_steps=6",
    "training.save_every=3",
    "training.max_staleness=2",
    f"inference.timeout_s={TIMEOUT_S}",
    "inference.max_retries=1",
]
BATCH = 2  # training.batch_size: two sampling requests (one per prompt) a batch
FAULT_AT = 4  # the batch the server fails on


@pytest.fixture(scope="module")
def served_model() -> ServedModel:
    return ServedModel()


@pytest.fixture(scope="module")
def straight_run(served_model: ServedModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted run's dir."""
    run_dir = tmp_path_factory.mktemp("straight")
    with sglang_server(served_model) as url:
        assert train(run_dir, url, *AHEAD)["state"] == "done"
    return run_dir


@pytest.fixture
def straight(straight_run: Path) -> list[dict[str, Any]]:
    """The uninterrupted run's metrics, timings aside."""
    return without_timing(read_metrics(straight_run))


class FromBatch:
    """Wraps /generate: it answers as it should until batch `at`'s first sampling request, then with `fault` (the
    freshness probes too when `probes_too`: the server is down); `began` holds when the fault began."""

    def __init__(self, at: int, fault: Route, probes_too: bool) -> None:
        self.at, self.fault, self.probes_too = at, fault, probes_too
        self.sampling = 0
        self.began = 0.0

    def __call__(self, generate: Route) -> Route:
        def route(body: dict) -> Any:
            probe = is_probe(body)
            self.sampling += not probe
            if self.sampling <= self.at * BATCH or (probe and not self.probes_too):
                return generate(body)
            self.began = self.began or time.monotonic()
            return self.fault(body)

        return route


def failed_then_resumed(
    served_model: ServedModel, run_dir: Path, straight: list[dict[str, Any]], wrap: FromBatch, release: threading.Event
) -> tuple[HttpError, float, str, list[int]]:
    """Run into the fault: the error, the seconds from the fault to the run's end, the url and the steps the failed
    run logged; then resume on a healthy server and check that every step trained once, with the uninterrupted
    run's metrics."""
    with sglang_server(served_model, wrap) as url:
        with pytest.raises(HttpError) as caught:
            train(run_dir, url, *AHEAD)
        ended = time.monotonic()
        release.set()
    status = RunDir(run_dir).read_status()
    assert status["state"] == "failed" and url in status["error"]
    assert [path.name for path in RunDir(run_dir).step_dirs()] == ["step_3"]  # the last periodic checkpoint
    failed = [record["step"] for record in read_metrics(run_dir)]
    assert failed == list(range(len(failed))) and 3 <= len(failed) <= FAULT_AT  # never past the failed batch

    with sglang_server(served_model) as healthy:
        assert train(run_dir, healthy, *AHEAD)["state"] == "done"
    resumed = read_metrics(run_dir)
    assert [record["step"] for record in resumed] == list(range(6))  # each step once
    assert without_timing(resumed) == straight  # the checkpoint is a barrier: resumed, it samples what the run did
    return caught.value, ended - wrap.began, url, failed


@pytest.mark.slow
def test_a_server_that_dies_while_a_batch_ahead_is_sampled_fails_the_run_naming_it(served_model, straight, tmp_path):
    """From batch 4's first request (sampled while step 3 trains) the server answers 500 to everything: the run fails
    after inference.max_retries with one line naming the url, and resumes from step_3 to the uninterrupted metrics."""

    def dead(body: dict) -> Any:
        return 500, {"error": "the server is gone"}, {}

    wrap = FromBatch(FAULT_AT, dead, probes_too=True)
    error, took, url, _ = failed_then_resumed(served_model, tmp_path, straight, wrap, threading.Event())
    message = str(error)
    assert "\n" not in message and url in message and "500" in message and "after 2 attempts" in message
    assert took < TIMEOUT_S + 25  # two attempts and a backoff, the steps trained meanwhile; no hang


@pytest.mark.slow
def test_a_server_that_stalls_while_a_batch_ahead_is_sampled_fails_within_its_timeout(served_model, straight, tmp_path):
    """From batch 4's first request (sampled while step 3 trains) the server never answers a sampling request (no stop
    request; its freshness probes it answers): inference.timeout_s ends the producer's request, the trainer raises
    its error when it needs batch 4, naming the url, and the run resumes from step_3 to the uninterrupted metrics."""
    release = threading.Event()

    def stalled(body: dict) -> Any:
        release.wait(120)
        return 503, {"error": "too late"}, {}

    wrap = FromBatch(FAULT_AT, stalled, probes_too=False)
    error, took, url, failed = failed_then_resumed(served_model, tmp_path, straight, wrap, release)
    message = str(error)
    assert "\n" not in message and url in message and f"no complete answer within {TIMEOUT_S} s" in message
    assert TIMEOUT_S - 0.5 <= took < TIMEOUT_S + 25  # the timeout ended it, not a hang
    assert failed == [0, 1, 2, 3]  # step 3 trained and synced meanwhile; the trainer then waited for batch 4


HANGS = ["reward._target_=tests.plugins.training_plugins.hanging_reward", "scoring.timeout_s=1", "training.max_steps=6"]


@pytest.mark.slow
def test_a_reward_that_hangs_on_the_producers_thread_is_bounded_as_at_k0(served_model, tmp_path):
    """A reward that never returns on some problems: each of those completions ends at scoring.timeout_s, scores 0 and
    counts in reward/errors and reward/timeouts; the run goes on. Sampling ahead (scoring on the producer's thread)
    counts exactly what k = 0 counts, step by step: the problems are the same, whatever the weights."""
    counted = {}
    for k in (0, 2):
        with sglang_server(served_model) as url:
            assert train(tmp_path / f"k{k}", url, *HANGS, f"training.max_staleness={k}")["state"] == "done"
        records = read_metrics(tmp_path / f"k{k}")
        assert [record["step"] for record in records] == list(range(6))
        counted[k] = [(r["reward/errors"], r["reward/timeouts"], r["reward/excluded"]) for r in records]
    assert counted[2] == counted[0]
    timeouts = [timeouts for _, timeouts, _ in counted[0]]
    assert sum(timeouts) > 0 and all(count % 4 == 0 for count in timeouts)  # a hung problem: its group of four


STRAGGLE_S = 3.0
# partial credit: most groups have signal, so most steps update the weights (and sync them, with a freshness probe)
PARTIAL_CREDIT = ["reward._target_=tests.plugins.training_plugins.digit_count_reward", "training.max_steps=6"]


def probes_during_a_straggle(served_model: ServedModel, run_dir: Path, k: int) -> int:
    """Run six steps in which batch 3's first sampling request takes STRAGGLE_S longer; how many freshness probes (one
    per optimizer step's sync: the trainer trained) the server answered meanwhile."""
    sampling, straggle, probes = [0], [0.0, 0.0], []

    def straggler(generate: Route) -> Route:
        def route(body: dict) -> Any:
            if is_probe(body):
                probes.append(time.monotonic())
            else:
                sampling[0] += 1
                if sampling[0] == 3 * BATCH + 1:
                    straggle[0] = time.monotonic()
                    time.sleep(STRAGGLE_S)
                    straggle[1] = time.monotonic()
            return generate(body)

        return route

    with sglang_server(served_model, straggler) as url:
        assert train(run_dir, url, *PARTIAL_CREDIT, f"training.max_staleness={k}")["state"] == "done"
    assert straggle[1] > 0
    return sum(straggle[0] < probe < straggle[1] for probe in probes)


@pytest.mark.slow
def test_the_trainer_trains_on_while_a_straggling_request_holds_a_batch_ahead(served_model, tmp_path):
    """At k = 2 the batch with the straggling request is sampled two steps ahead: the trainer trains and syncs steps
    1 and 2 meanwhile (the server answers their freshness probes during the straggle). At k = 0 the trainer waits for
    it: nothing is trained during the straggle."""
    assert probes_during_a_straggle(served_model, tmp_path / "k0", 0) == 0
    assert probes_during_a_straggle(served_model, tmp_path / "k2", 2) >= 1


@pytest.mark.slow
def test_a_stop_that_finds_a_batch_ahead_failed_still_checkpoints_the_steps_trained(served_model, tmp_path, caplog):
    """k = 2, no periodic checkpoint: the server fails batch 4's requests (sampled ahead, pinned to step 2's weights)
    and a graceful stop comes after step 2. The stop checkpoints steps 0-2 and keeps batch 3, finished before the
    failure, instead of failing with nothing saved; the resumed run trains batch 3 as planned, samples 4 and 5 again
    with the restored weights, and trains every step once."""
    overrides = ["training.max_steps=6", "training.max_staleness=2", "inference.max_retries=1"]
    with sglang_server(served_model) as url:
        assert train(tmp_path / "straight", url, *overrides)["state"] == "done"
    straight = without_timing(read_metrics(tmp_path / "straight"))

    def dead(body: dict) -> Any:
        return 500, {"error": "the server is gone"}, {}

    run_dir = tmp_path / "stopped"
    failing = FromBatch(4, dead, probes_too=False)
    with sglang_server(served_model, failing) as url, caplog.at_level(logging.WARNING), ExitStack() as parts:
        assert stopped_after(trainer_of(run_dir, url, parts, *overrides), 3).run()["state"] == "stopped"
    assert "a batch sampled ahead failed (HttpError" in caplog.text and url in caplog.text
    assert [path.name for path in RunDir(run_dir).step_dirs()] == ["step_3"]
    assert [batch.step for batch in load_sampled_ahead(run_dir / "checkpoints" / "step_3", 2)] == [3]
    assert without_timing(read_metrics(run_dir)) == straight[:3]

    with sglang_server(served_model) as url:
        assert train(run_dir, url, *overrides)["state"] == "done"
    resumed = read_metrics(run_dir)
    assert [record["step"] for record in resumed] == list(range(6))
    assert without_timing(resumed)[:4] == straight[:4]  # batch 3 was kept: sampled with step 1's weights, as planned
    restored = resumed[3]["engine/weight_version"] + resumed[3]["engine/policy_lag"]  # the trainer's at step 3
    assert [record["engine/weight_version"] for record in resumed[4:]] == [restored, restored]


@pytest.mark.slow
def test_a_stop_that_finds_the_next_batch_failed_keeps_its_prompts_for_the_resumed_run(
    served_model, straight_run, tmp_path
):
    """As above, but the server fails batch 3, the first after the stop: the checkpoint keeps no batch, and its data
    position is the one before batch 3's prompts were drawn (the uninterrupted run's checkpoint before step 3 holds
    the same), so the resumed run draws them again: no prompt is skipped."""

    def dead(body: dict) -> Any:
        return 500, {"error": "the server is gone"}, {}

    no_periodic = [*AHEAD, "training.save_every=10"]
    run_dir = tmp_path / "stopped"
    with sglang_server(served_model, FromBatch(3, dead, probes_too=False)) as url, ExitStack() as parts:
        assert stopped_after(trainer_of(run_dir, url, parts, *no_periodic), 3).run()["state"] == "stopped"
    checkpoint = run_dir / "checkpoints" / "step_3"
    assert load_sampled_ahead(checkpoint, 2) == []
    before_step_3 = Checkpoint(straight_run / "checkpoints" / "step_3").state()["data"]
    assert Checkpoint(checkpoint).state()["data"] == before_step_3
