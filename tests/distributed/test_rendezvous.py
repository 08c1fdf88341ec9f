"""What `retrain doctor` and `retrain explain` say of a data-parallel launch."""

from __future__ import annotations

import pytest

from retrain.commands.explain import explain
from retrain.distributed.rendezvous import planned_world_size, rendezvous_problem
from retrain.distributed.world import launched_world
from retrain.errors import ConfigError

RANK0 = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def test_one_process_needs_no_rendezvous() -> None:
    assert rendezvous_problem({}) is None


def test_torchruns_variables_make_a_rendezvous() -> None:
    assert rendezvous_problem(RANK0) is None


def test_a_rank_without_its_master_or_past_the_world_is_named() -> None:
    assert rendezvous_problem({**RANK0, "MASTER_ADDR": None}) == (
        "MASTER_ADDR not set (start the ranks with torchrun, or hydra/launcher=slurm)"
    )
    assert rendezvous_problem({**RANK0, "RANK": "2"}) == "RANK=2 is not below WORLD_SIZE=2"


def test_the_slurm_launcher_plans_tasks_per_node_times_nodes() -> None:
    launcher = {"_target_": "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"}
    assert planned_world_size({**launcher, "tasks_per_node": 4, "nodes": 2}) == 8


def test_explain_shows_the_world_size_of_a_slurm_sweep() -> None:
    overrides = ["experiment=quickstart", "hydra/launcher=slurm", "hydra.launcher.tasks_per_node=2"]
    report = explain([*overrides, "hydra.launcher.nodes=3"], multirun=True)
    assert [run["world_size"] for run in report["runs"]] == [6]


@pytest.mark.parametrize("name", ["WORLD_SIZE", "RANK", "LOCAL_RANK"])
def test_a_rendezvous_variable_that_is_not_an_integer_is_named(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    for variable in ("SUBMITIT_EXECUTOR", "SUBMITIT_LOCAL_JOB_ID", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv(name, "abc")
    with pytest.raises(ConfigError, match=f"^{name}='abc' in the environment is not an integer"):
        launched_world()


def test_explain_names_a_world_size_that_is_not_an_integer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "abc")
    with pytest.raises(ConfigError, match="^WORLD_SIZE='abc'"):
        planned_world_size({})
