"""A two-rank run on two inference servers (inference=sglang, two loopback servers answering with the real tiny
model) samples, scores and trains the quickstart's first step as one process on one server does: groups go
round-robin over the servers by their global index, and each rank serves its own adapter names."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from retrain.training.sampled_ahead import SAMPLED_AHEAD_FILE
from tests.conftest import SMALL_BATCH, checked, cli_env, read_metrics, run_cli, without_timing
from tests.distributed import TORCHRUN
from tests.distributed.test_same_as_one_rank import STEPS, assert_first_step_as_one, generations
from tests.distributed.test_stop import rank_pid
from tests.inference.fake_servers import ServedModel, sglang_routes
from tests.inference.loopback import serve

# four groups of four a step: the servers' sampling (the tiny model in this process) is most of these runs' time
ON_SGLANG = [*STEPS, *SMALL_BATCH, "inference=sglang"]
# sampling one step ahead (the window where a rank's two threads issue collectives at once is opened by
# tests/distributed/ranks.py: crossed_collectives)
AHEAD = [*(o for o in ON_SGLANG if not o.startswith("training.max_steps")), "training.max_staleness=1"]


def sampled(server) -> int:
    return sum(isinstance(r.body.get("sampling_params"), list) for r in server.asked("/generate"))


def loaded(server) -> set[str]:
    return {r.body["lora_name"] for r in server.asked("/load_lora_adapter")}


@pytest.mark.slow
def test_two_ranks_on_two_servers_sample_and_train_the_first_step_as_one_on_one(tmp_path: Path) -> None:
    with serve(sglang_routes(ServedModel())) as a, serve(sglang_routes(ServedModel())) as b:
        one = tmp_path / "one" / "run"
        run_cli([*ON_SGLANG, f"inference.url={a.url}", f"hydra.run.dir={one}"], cwd=tmp_path)
        for server in (a, b):
            server.requests.clear()
        command = [*TORCHRUN, "--nproc-per-node=2", "-m", "retrain", *ON_SGLANG, f"inference.url=[{a.url},{b.url}]"]
        checked(subprocess.run(command, cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=600))
    (two,) = (tmp_path / "outputs" / "runs").glob("*/*")  # one run dir, written by rank 0
    assert_first_step_as_one(two, one)
    assert sampled(a) == sampled(b) > 0  # an even number of groups per call: half on each server
    for server in (a, b):  # each rank loads each version on every server under its own name
        assert {"policy-v0-r0", "policy-v0-r1", "policy-v1-r0", "policy-v1-r1"} <= loaded(server)


@pytest.mark.slow
def test_two_ranks_sampling_ahead_on_two_servers_train_as_one_process_does(tmp_path: Path) -> None:
    """k = 1 on two ranks: each rank's producer gathers the batches ahead on a group of its own, and the run
    samples, scores and trains what one process sampling ahead on one server does."""
    ahead = [*AHEAD, "training.max_steps=4"]
    with serve(sglang_routes(ServedModel())) as a, serve(sglang_routes(ServedModel())) as b:
        one = tmp_path / "one" / "run"
        run_cli([*ahead, f"inference.url={a.url}", f"hydra.run.dir={one}"], cwd=tmp_path)
        command = [*TORCHRUN, "--nproc-per-node=2", "-m", "retrain", *ahead, f"inference.url=[{a.url},{b.url}]"]
        checked(subprocess.run(command, cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=600))
    (two,) = (tmp_path / "outputs" / "runs").glob("*/*")
    assert_first_step_as_one(two, one)
    assert generations(two, 1) == generations(one, 1)  # sampled ahead with the same (initial) weights
    records = {run: read_metrics(run) for run in (one, two)}
    for run, steps in records.items():
        assert [r["engine/policy_lag"] for r in steps] == [0, 1, 1, 1], run
        assert all(r["async/trainer_wait_s"] >= 0 and "mismatch/kl" in r for r in steps[1:]), run
    for mine, theirs in zip(records[two], records[one], strict=True):
        for key in ("num_datums", "num_tokens", "mean_reward"):
            assert mine[key] == pytest.approx(theirs[key]), (mine["step"], key)


@pytest.mark.slow
def test_two_ranks_sampling_ahead_stopped_by_a_signal_to_one_resume_as_if_never_stopped(tmp_path: Path) -> None:
    """SIGTERM to rank 1 alone while both ranks' producers sample the next batch: every rank waits for the batches
    pinned to the trained weights (their gathers need each other), rank 0 checkpoints them, and the resumed run
    trains on exactly the batches the uninterrupted run did."""
    ahead = [*AHEAD, "training.max_steps=6", "training.save_every=0"]
    with serve(sglang_routes(ServedModel())) as a, serve(sglang_routes(ServedModel())) as b:
        ranks = [*TORCHRUN, "--nproc-per-node=2", "-m", "retrain", *ahead, f"inference.url=[{a.url},{b.url}]"]
        stopped, whole = tmp_path / "stopped", tmp_path / "whole"
        launcher = subprocess.Popen(
            [*ranks, f"hydra.run.dir={stopped}"], cwd=tmp_path, env=cli_env(), stdout=subprocess.DEVNULL
        )
        try:
            deadline = time.monotonic() + 300
            while not ((stopped / "metrics.jsonl").is_file() and (stopped / "metrics.jsonl").read_text().strip()):
                assert time.monotonic() < deadline and launcher.poll() is None, "the run never logged a step"
                time.sleep(0.05)
            os.kill(rank_pid(launcher.pid, 1) or 0, signal.SIGTERM)
            launcher.wait(timeout=300)
        finally:
            if launcher.poll() is None:
                launcher.kill()
        status = json.loads((stopped / "status.json").read_text())
        assert status["state"] == "stopped" and status["step"] < 5
        (checkpoint,) = (stopped / "checkpoints").iterdir()
        assert (checkpoint / SAMPLED_AHEAD_FILE).is_file()  # the batch pinned to the trained weights
        for run_dir in (stopped, whole):  # resumed; and the run never stopped
            run = [*ranks, f"hydra.run.dir={run_dir}"]
            checked(subprocess.run(run, cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=600))
    assert without_timing(read_metrics(stopped)) == without_timing(read_metrics(whole))
