"""The public data files in ../shared/data (MATH-500, GSM8K), reached relative to this checkout."""

from __future__ import annotations

from pathlib import Path

import pytest

SHARED_DATA = Path(__file__).resolve().parents[2] / ".." / "shared" / "data"


def _shared(relative: str) -> Path:
    path = (SHARED_DATA / relative).resolve()
    if not path.exists():
        pytest.skip(
            f"{relative} not found under {SHARED_DATA.resolve()} (the shared data sets are not beside this checkout)"
        )
    return path


@pytest.fixture
def math500() -> Path:
    """MATH-500 test.jsonl: problem, solution, answer, subject, level, unique_id (500 records)."""
    return _shared("math/test.jsonl")


@pytest.fixture
def gsm8k_dir() -> Path:
    """GSM8K train.jsonl (7473) and test.jsonl (1319): question, answer ending in '#### N'."""
    return _shared("gsm8k")
