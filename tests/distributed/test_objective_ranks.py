"""Every loss aggregation's normaliser counts the whole step over the ranks: a step on two gloo ranks, each training
its share of the rows, has the loss and gradient of the same step in one process (tests/distributed/objective_ranks.py)."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from tests.conftest import REPO, checked, cli_env
from tests.distributed import TORCHRUN
from tests.distributed.objective_ranks import SETTINGS


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("objective_ranks")
    command = [*TORCHRUN, "--nproc-per-node=2", str(REPO / "tests" / "distributed" / "objective_ranks.py"), str(out)]
    checked(subprocess.run(command, env=cli_env(), capture_output=True, text=True, timeout=600, cwd=REPO))
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_two_ranks_train_the_one_process_step(ranks: list[dict], setting: str) -> None:
    one = ranks[0]["one"][setting]
    assert one["loss"] != 0 and one["gradient"]
    for rank in ranks:
        assert rank["two"][setting]["loss"] == pytest.approx(one["loss"], rel=1e-5, abs=1e-7)
        torch.testing.assert_close(
            torch.tensor(rank["two"][setting]["gradient"]), torch.tensor(one["gradient"]), rtol=1e-5, atol=1e-6
        )
