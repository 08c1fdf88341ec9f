from __future__ import annotations

from pathlib import Path

import pytest

from tests.backend.tiny_model import tiny_spec  # noqa: F401  (fixture)

ENVS = Path(__file__).parent / "envs"  # the test environments: top-level modules, as verifiers imports taskset ids


@pytest.fixture
def test_envs(monkeypatch) -> Path:
    monkeypatch.syspath_prepend(str(ENVS))
    return ENVS
