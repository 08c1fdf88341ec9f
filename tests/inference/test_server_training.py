"""The trainer against a server engine (inference=sglang on a loopback server serving the real tiny model):
it stops when optimizer steps keep being skipped, it proves the sampling route fresh (not only the probe),
a first Ctrl-C during a stuck request checkpoints and stops, to resume exactly, and a run sampling ahead
(training.max_staleness) resumes on the batches it sampled ahead."""

from __future__ import annotations

import gc
import logging
import signal
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest

from retrain.campaign.preemption import requeue_on_preemption
from retrain.config import compose
from retrain.errors import UserError
from retrain.housekeeping.rundir import RunDir
from retrain.model.probe import StaleWeightsError
from retrain.run import build_trainer
from retrain.training.producer import Producer
from retrain.training.sampled_ahead import load_sampled_ahead
from tests.conftest import QUICK, read_metrics, without_timing
from tests.inference.fake_servers import ServedModel, sglang_routes
from tests.inference.loopback import Route, serve
from tests.test_split_mode import stopped_after

ON_SGLANG = [*QUICK, "training.batch_size=2", "training.group_size=4", "training.save_every=10", "inference=sglang"]


@pytest.fixture(scope="module")
def served_model():
    return ServedModel()


@contextmanager
def sglang_server(model: ServedModel, wrap=None) -> Iterator[str]:
    """SGLang's API on loopback; `wrap(generate)` may change how /generate answers."""
    model.adapters.clear()
    routes = sglang_routes(model)
    if wrap is not None:
        routes["POST /generate"] = wrap(routes["POST /generate"])
    with serve(routes) as loopback:
        yield loopback.url


def trainer_of(run_dir: Path, url: str, parts: ExitStack, *overrides: str):
    return build_trainer(compose([*ON_SGLANG, f"inference.url={url}", *overrides]), run_dir, parts)


def train(run_dir: Path, url: str, *overrides: str) -> dict[str, Any]:
    with ExitStack() as parts:
        return trainer_of(run_dir, url, parts, *overrides).run()


def is_probe(body: dict) -> bool:
    return body.get("logprob_start_len") is not None


def absurd_logprobs(generate: Route) -> Route:
    """A server that samples as it should but reports each sampled token's log-prob as -1e30 (finite, absurd)."""

    def route(body):
        status, answers, headers = generate(body)
        if not is_probe(body):
            for answer in answers:
                for triple in answer["meta_info"]["output_token_logprobs"]:
                    triple[0] = -1e30
        return status, answers, headers

    return route


@pytest.mark.slow
def test_consecutive_skipped_steps_stop_the_run(served_model, tmp_path):
    """A server whose log-probs are finite but absurd (-1e30) makes every step's loss non-finite: the run
    fails after training.max_skipped_steps instead of ending `done` with an untrained adapter."""

    with sglang_server(served_model, absurd_logprobs) as url, pytest.raises(UserError) as caught:
        train(
            tmp_path,
            url,
            "training.max_steps=6",
            "training.max_skipped_steps=2",
            "training.logprob_diff_tolerance=inf",
            "training.mismatch_mode=none",  # uncorrected: a server's default, truncated IS, caps the absurd ratio
        )
    assert "2 optimizer steps in a row were skipped" in str(caught.value)
    assert "training.max_skipped_steps=2" in str(caught.value)
    assert RunDir(tmp_path).read_status()["state"] == "failed"
    assert not any(record["grad_norm"] for record in read_metrics(tmp_path) if not record["skipped_nonfinite"])


@pytest.mark.slow
def test_truncated_is_trains_through_a_servers_absurd_logprobs(served_model, tmp_path):
    """The same absurd server under a server engine's default correction (truncated IS, cap 2): the ratio
    against the trainer's own old log-probs stays finite, every token's weight is the cap, and the run trains."""

    with sglang_server(served_model, absurd_logprobs) as url:
        train(tmp_path, url, "training.max_steps=3", "training.logprob_diff_tolerance=inf")
    assert RunDir(tmp_path).read_status()["state"] == "done"
    records = read_metrics(tmp_path)
    trained = [record for record in records if record["num_tokens"]]
    assert trained and not any(record["skipped_nonfinite"] for record in records)
    assert all(record["mismatch/truncated_frac"] == 1.0 for record in trained)


@pytest.mark.slow
def test_a_server_that_samples_with_old_weights_fails_the_sampling_route_check(served_model, tmp_path):
    """It loads every adapter and scores the probe with the one it was asked for (the probe passes), but
    samples with the first adapter it served: engine/logprob_abs_diff on the sampled tokens gives it away."""

    def stale_sampler(generate: Route) -> Route:
        def route(body):
            if not is_probe(body):
                served_model.alias("first", body["lora_path"][0])
                body = {**body, "lora_path": ["first"] * len(body["input_ids"])}
            return generate(body)

        return route

    with sglang_server(served_model, stale_sampler) as url, pytest.raises(StaleWeightsError) as caught:
        train(tmp_path, url, "training.max_steps=4")
    message = str(caught.value)
    assert "samples with other weights than the trainer's" in message and "engine/logprob_abs_diff" in message
    records = read_metrics(tmp_path)
    assert records and all(record.get("engine/logprob_abs_diff", 0.0) < 1e-4 for record in records)  # the steps before


@pytest.mark.slow
def test_a_first_ctrl_c_during_a_stuck_request_checkpoints_stops_and_resumes_exactly(served_model, tmp_path, caplog):
    steps, stuck_at = 4, 2
    with sglang_server(served_model) as url:
        train(tmp_path / "straight", url, f"training.max_steps={steps}")
    straight = without_timing(read_metrics(tmp_path / "straight"))

    sampling_requests = [0]
    arrived, release = threading.Event(), threading.Event()

    def stuck_at_step(generate: Route) -> Route:
        def route(body):
            if not is_probe(body):
                sampling_requests[0] += 1
                if sampling_requests[0] > stuck_at * 2:  # batch_size 2: two requests per step
                    arrived.set()
                    release.wait(30)  # the server hangs on this step's request
            return generate(body)

        return route

    run_dir = tmp_path / "interrupted"
    # delivered to a thread other than the main one, as the kernel may deliver a process's Ctrl-C (seen in CI)
    ctrl_c = threading.Thread(
        target=lambda: arrived.wait(60) and signal.pthread_kill(threading.get_ident(), signal.SIGINT), daemon=True
    )
    with sglang_server(served_model, stuck_at_step) as url, caplog.at_level(logging.WARNING):
        ctrl_c.start()
        with ExitStack() as parts, pytest.raises(SystemExit) as exit:
            trainer = trainer_of(run_dir, url, parts, f"training.max_steps={steps}")
            with requeue_on_preemption(trainer):
                trainer.run()
        release.set()
    gc.collect()
    assert exit.value.code == 128 + signal.SIGINT
    assert RunDir(run_dir).read_status()["state"] == "stopped"
    assert [path.name for path in RunDir(run_dir).step_dirs()] == [f"step_{stuck_at}"]
    assert "destroyed" not in caplog.text and "Stopped while sampling" in caplog.text

    with sglang_server(served_model) as url:
        assert train(run_dir, url, f"training.max_steps={steps}")["state"] == "done"
    assert without_timing(read_metrics(run_dir)) == straight


ON_SERVER = ["training.max_steps=6", "training.save_every=3", "training.max_staleness=2"]


def server_trained(run_dir: Path, url: str, stop_after: int | None = None) -> dict:
    with ExitStack() as parts:
        trainer = trainer_of(run_dir, url, parts, *ON_SERVER)
        return (stopped_after(trainer, stop_after) if stop_after else trainer).run()


@pytest.mark.slow
def test_a_server_run_samples_two_steps_ahead_and_resumes_exactly(served_model, tmp_path: Path) -> None:
    """inference=sglang with k = 2: the producer samples while the trainer trains (up to two steps behind after each
    checkpoint), and a stop after step 4 keeps step 5's batch, sampled with step 3's weights, for the resumed run."""
    with sglang_server(served_model) as url:
        assert server_trained(tmp_path / "full", url)["state"] == "done"
    with sglang_server(served_model) as url:
        assert server_trained(tmp_path / "stopped", url, 5)["state"] == "stopped"
    checkpoint = tmp_path / "stopped" / "checkpoints" / "step_5"
    assert [batch.step for batch in load_sampled_ahead(checkpoint, 2)] == [5]
    with sglang_server(served_model) as url:
        assert server_trained(tmp_path / "stopped", url)["state"] == "done"
    full, resumed = read_metrics(tmp_path / "full"), read_metrics(tmp_path / "stopped")
    # batch t is sampled with the weights step 0 (t < 3) or step 3 (a checkpoint) trained with; a step whose groups
    # were all uniform updates nothing, so the lag in optimizer steps is at most t - that step
    trained_with = [r["engine/weight_version"] + r["engine/policy_lag"] for r in full]
    assert [r["engine/weight_version"] for r in full] == [trained_with[t] for t in (0, 0, 0, 3, 3, 3)]
    assert max(r["engine/policy_lag"] for r in full) <= 2
    assert without_timing(resumed) == without_timing(full)


@pytest.mark.slow
def test_a_server_serves_the_versions_batches_are_pinned_to_while_newer_ones_load(served_model, tmp_path):
    """k = 2 without barriers: each batch names the adapter of the weights it is pinned to, newer versions load
    without waiting for the batches ahead (the server holds up to k + 1 at once), and every lag stays <= k."""
    named: list[tuple[str, int]] = []  # (the adapter a sampling request names, adapters loaded then)

    def recording(generate: Route) -> Route:
        def route(body):
            if not is_probe(body):
                named.append((body["lora_path"][0], len(served_model.adapters)))
            return generate(body)

        return route

    with sglang_server(served_model, recording) as url:
        assert train(tmp_path, url, "training.max_steps=6", "training.max_staleness=2")["state"] == "done"
    metrics = read_metrics(tmp_path)
    # two requests (prompts) a batch, in step order: the producer samples one batch at a time
    assert [name for name, _ in named[::2]] == [f"policy-v{r['engine/weight_version']}" for r in metrics]
    trained_with = [r["engine/weight_version"] + r["engine/policy_lag"] for r in metrics]  # a step may update nothing
    assert [r["engine/weight_version"] for r in metrics] == [trained_with[max(t - 2, 0)] for t in range(6)]
    assert max(r["engine/policy_lag"] for r in metrics) <= 2
    assert max(loaded for _, loaded in named) == 3 and len(served_model.adapters) == 0  # all unloaded at the end
    waits = [r["overlap_wait_s"] for r in metrics]
    assert max(waits) < 0.05, waits  # no wait for the batches ahead before a sync


@pytest.mark.slow
def test_a_stop_while_a_server_stalls_on_a_batch_ahead_ends_in_bounded_time(
    served_model, tmp_path, caplog, monkeypatch
):
    """k = 1: batch 2 (sampled while step 1 trains) hangs on the server. A Ctrl-C lets it run Producer.STOP_GRACE_S,
    then interrupts it: step 1 still counts, the stop's checkpoint holds steps 0-1, and the resumed run samples
    batch 2 again with the weights it restored (lag 0): no step is trained twice or lost."""
    monkeypatch.setattr(Producer, "STOP_GRACE_S", 0.5)
    overrides = ["training.max_steps=4", "training.max_staleness=1"]
    with sglang_server(served_model) as url:
        train(tmp_path / "straight", url, *overrides)
    straight = without_timing(read_metrics(tmp_path / "straight"))

    sampling_requests = [0]
    arrived, release = threading.Event(), threading.Event()

    def stuck_at_batch_2(generate: Route) -> Route:
        def route(body):
            if not is_probe(body):
                sampling_requests[0] += 1
                if sampling_requests[0] > 2 * 2:  # batch_size 2: two requests per batch
                    arrived.set()
                    release.wait(30)
            return generate(body)

        return route

    run_dir = tmp_path / "stopped"
    # delivered to a thread other than the main one, as the kernel may deliver a process's Ctrl-C (seen in CI)
    ctrl_c = threading.Thread(
        target=lambda: arrived.wait(60) and signal.pthread_kill(threading.get_ident(), signal.SIGINT), daemon=True
    )
    with sglang_server(served_model, stuck_at_batch_2) as url, caplog.at_level(logging.WARNING):
        ctrl_c.start()
        with ExitStack() as parts, pytest.raises(SystemExit):
            trainer = trainer_of(run_dir, url, parts, *overrides)
            with requeue_on_preemption(trainer):
                trainer.run()
        release.set()
    assert RunDir(run_dir).read_status()["state"] == "stopped"
    assert [path.name for path in RunDir(run_dir).step_dirs()] == ["step_2"]
    # the Ctrl-C lands while the trainer drains the batches ahead after step 1 (the grace, then the interrupt) or,
    # on a loaded machine, once it waits for batch 2 itself (interrupted at once): the same checkpoint either way
    assert "Stopped while sampling" in caplog.text
    assert without_timing(read_metrics(run_dir)) == straight[:2]

    with sglang_server(served_model) as url:
        assert train(run_dir, url, *overrides)["state"] == "done"
    resumed = read_metrics(run_dir)
    assert [r["step"] for r in resumed] == [0, 1, 2, 3]
    assert [r["engine/policy_lag"] for r in resumed[2:]] == [0, 1]  # batch 2 sampled with the restored weights
