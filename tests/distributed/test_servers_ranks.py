"""A two-rank run on two inference servers (inference=sglang, two loopback servers answering with the real tiny
model) samples, scores and trains the quickstart's first step as one process on one server does: groups go
round-robin over the servers by their global index, and each rank serves its own adapter names."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.conftest import checked, cli_env, read_metrics, run_cli
from tests.distributed import TORCHRUN
from tests.distributed.test_same_as_one_rank import STEPS, assert_first_step_as_one, generations
from tests.inference.fake_servers import ServedModel, sglang_routes
from tests.inference.loopback import serve

ON_SGLANG = [*STEPS, "inference=sglang"]


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
    """k = 1 on two ranks: each rank's producer gathers the next step's shares on a group of its own while the
    trainers all-reduce the current step's gradients (the window opens on every step), and the run samples,
    scores and trains what one process sampling ahead on one server does."""
    ahead = [*(o for o in ON_SGLANG if not o.startswith("training.max_steps")), "training.max_steps=4"]
    ahead.append("training.max_staleness=1")
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
