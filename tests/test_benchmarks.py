"""The benchmark scripts keep running (tiny sizes; their timings are not checked here)."""

from __future__ import annotations

import os
import subprocess
import sys

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
