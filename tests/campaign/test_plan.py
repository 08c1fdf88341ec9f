"""The multirun plan is the order Hydra's basic sweeper launches in: checked against a real Hydra multirun."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from retrain.campaign.plan import expand
from retrain.errors import ConfigError

# A bare Hydra app whose jobs print their number and overrides; its sweeper params come from its config.
APP = """
import json
import hydra
from hydra.core.hydra_config import HydraConfig

@hydra.main(version_base="1.3", config_path=".", config_name="config")
def app(cfg):
    job = HydraConfig.get().job
    print("JOB " + json.dumps([job.num, list(HydraConfig.get().overrides.task)]))

app()
"""
CONFIG = """
x: 0
y: a
hydra:
  sweeper:
    params:
      x: 1,2
      y: a,b
"""


def launched_jobs(tmp_path: Path, arguments: list[str]) -> list[tuple[int, list[str]]]:
    (tmp_path / "app.py").write_text(APP)
    (tmp_path / "config.yaml").write_text(CONFIG)
    result = subprocess.run(
        [sys.executable, "app.py", "--multirun", *arguments, f"hydra.sweep.dir={tmp_path}/sweep"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    jobs = [json.loads(line[4:]) for line in result.stdout.splitlines() if line.startswith("JOB ")]
    return [(num, overrides) for num, overrides in jobs]


def test_plan_numbers_jobs_as_hydra_launches_them(tmp_path: Path) -> None:
    # Sweeper params first; the command line adds keys (+z), replaces y's values but keeps y's place.
    command_line = ["+z=5,6", "y=c,d", "x=range(1,3)"]
    plan = expand(["x=1,2", "y=a,b", *command_line])
    assert [(job.num, job.overrides) for job in plan] == launched_jobs(tmp_path, command_line)
    assert [job.overrides for job in plan[:3]] == [
        ["x=1", "y=c", "+z=5"],
        ["x=1", "y=c", "+z=6"],
        ["x=1", "y=d", "+z=5"],
    ]


def test_condition_and_seed_come_from_the_overrides() -> None:
    plan = expand(["algorithm=grpo_none,maxrl_gtpo_sepa", "training.seed=1,2", "training.max_steps=3"])
    assert [(job.condition, job.seed) for job in plan] == [
        ("grpo_none", 1),
        ("grpo_none", 2),
        ("maxrl_gtpo_sepa", 1),
        ("maxrl_gtpo_sepa", 2),
    ]
    assert all(job.overrides[-1] == "training.max_steps=3" for job in plan)
    assert [(job.condition, job.seed) for job in expand(["training.max_steps=3"])] == [(None, None)]


def test_a_sweep_the_basic_sweeper_cannot_run_is_named() -> None:
    with pytest.raises(ConfigError, match=r"training.lr=interval\(0.1,1\): the basic sweeper sweeps only"):
        expand(["training.lr=interval(0.1,1)"])
