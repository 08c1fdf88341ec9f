"""Shared test helpers: compose the real config tree, and run the real CLI in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig

from retrain.cli import config_dir
from retrain.config import register_configs

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


def compose_config(overrides: list[str] | None = None) -> DictConfig:
    """The primary config exactly as `python -m retrain <overrides>` composes it."""
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        return compose(config_name="config", overrides=overrides or [], return_hydra_config=False)


def run_cli(args: list[str], cwd: Path, timeout: float = 600, env: dict[str, str] | None = None,
            check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run `python -m retrain ...` as a user would (tests/ importable for plugins)."""
    full_env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                "OMP_NUM_THREADS": "1", **(env or {})}
    result = subprocess.run([sys.executable, "-m", "retrain", *args], cwd=cwd, env=full_env,
                            capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"retrain {' '.join(args)} failed ({result.returncode}):\n"
                             f"{result.stdout[-4000:]}\n{result.stderr[-6000:]}")
    return result


def read_metrics(run_dir: Path) -> list[dict]:
    with open(run_dir / "metrics.jsonl") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def without_timing(records: list[dict]) -> list[dict]:
    """Metrics minus wall-clock fields (they end in `_s`), for reproducibility comparisons."""
    return [{k: v for k, v in r.items() if not k.endswith("_s")} for r in records]


@pytest.fixture
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data sets not found at {SHARED_DATA}")
    return SHARED_DATA
