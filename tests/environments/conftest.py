from __future__ import annotations

from pathlib import Path

import pytest

from tests.backend.tiny_model import tiny_spec  # noqa: F401  (fixture)

ENVS = Path(__file__).parent / "envs"  # the test environments: top-level modules, as verifiers imports taskset ids


@pytest.fixture
def test_envs(monkeypatch) -> Path:
    monkeypatch.syspath_prepend(str(ENVS))
    return ENVS


def tiny_run_args(run_dir: Path, steps: int) -> list[str]:
    """A run on the tiny model on CPU: `steps` steps of 2 tasks × 4 episodes, 8 tokens a turn, a checkpoint each step."""
    return [
        "model=tiny",
        "backend.devices=cpu",
        "algorithm=grpo_none",
        "training.seed=0",  # the default -1 draws a seed per run, and a run of all-uniform groups trains nothing
        f"training.max_steps={steps}",
        "training.batch_size=2",
        "training.group_size=4",
        "training.max_tokens=8",
        "training.save_every=1",
        "logging.progress_bar=false",
        f"hydra.run.dir={run_dir}",
    ]
