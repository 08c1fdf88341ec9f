"""`recipe=<paper>` (conf/recipe/): each sets its paper's loss keys (and advantage), composes with any
experiment and algorithm, and trains; `+campaign=recipes` plans one condition per recipe."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import yaml
from omegaconf import OmegaConf

from retrain.config import compose, config_dir
from tests.conftest import QUICK, CliHere, read_metrics, run_cli

RECIPES = sorted(p.stem for p in (Path(config_dir()) / "recipe").glob("*.yaml"))
PAPER = {  # the papers' values (docs/recipes.md)
    "grpo": {"objective": "ppo", "clip_eps": 0.2, "loss_agg": "seq_mean_token_mean", "kl_coef": 0.04},
    "dr_grpo": {"objective": "ppo", "clip_eps": 0.2, "loss_agg": "seq_sum_norm", "kl_coef": 0.0},
    "gspo": {"objective": "gspo", "clip_eps": None, "loss_agg": None, "kl_coef": 0.0},
    "cispo": {"objective": "cispo", "clip_eps": None, "loss_agg": None, "kl_coef": 0.0},
}
PAPER_ADVANTAGE = {"grpo": "grpo_std_none", "dr_grpo": "grpo_none", "gspo": "grpo_std_none", "cispo": "grpo_std_none"}


def recipe_file(name: str) -> dict[str, Any]:
    return yaml.safe_load((Path(config_dir()) / "recipe" / f"{name}.yaml").read_text())


def leaves(node: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{dotted key: value} of a mapping's leaves."""
    out: dict[str, Any] = {}
    for key, value in node.items():
        if isinstance(value, dict):
            out.update(leaves(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def test_the_four_papers_recipes_are_there() -> None:
    assert set(PAPER) <= set(RECIPES)


@pytest.mark.parametrize("name", RECIPES)
def test_a_recipe_sets_its_keys_over_the_experiment_and_nothing_else(name: str) -> None:
    quickstart = compose(["experiment=quickstart"])
    config = compose(["experiment=quickstart", f"recipe={name}"])
    settings = leaves({k: v for k, v in recipe_file(name).items() if k != "defaults"})
    assert settings, f"recipe {name} sets nothing"
    for key, value in settings.items():
        assert OmegaConf.select(config, key) == value, key
    for key in ["training.lr", "training.batch_size", "training.group_size", "training.max_steps", "model.name"]:
        assert OmegaConf.select(config, key) == OmegaConf.select(quickstart, key), key  # the experiment's own
    if name in PAPER:
        assert {k: config.training[k] for k in PAPER[name]} == PAPER[name]
        assert config.algorithm.name == PAPER_ADVANTAGE[name]


@pytest.mark.parametrize("name", RECIPES)
def test_an_algorithm_on_the_command_line_wins_over_the_recipes(name: str) -> None:
    for overrides in (
        [f"recipe={name}", "algorithm=maxrl_gtpo_sepa"],
        ["algorithm=maxrl_gtpo_sepa", f"recipe={name}"],
    ):
        config = compose(["experiment=quickstart", *overrides])
        assert config.algorithm.name == "maxrl_gtpo_sepa"
        assert config.training.objective == compose(["experiment=quickstart", f"recipe={name}"]).training.objective


def test_no_recipe_keeps_the_defaults() -> None:
    config = compose(["experiment=quickstart"])
    assert OmegaConf.select(config, "recipe") is None
    assert (config.training.objective, config.training.clip_eps, config.training.loss_agg) == ("ppo", None, None)
    assert (config.training.kl_coef, config.algorithm.name) == (0.0, "maxrl_gtpo_sepa")


def test_help_lists_the_recipes(tmp_path: Path, cli_here: CliHere) -> None:
    out = cli_here(["--help"], cwd=tmp_path).stdout
    assert "recipe: " + ", ".join(RECIPES) in out


@pytest.mark.slow
@pytest.mark.parametrize("name", RECIPES)
def test_a_recipe_trains_two_steps_with_a_finite_loss(name: str, tmp_path: Path, cli_here: CliHere) -> None:
    run_dir = tmp_path / name
    cli_here(
        [*QUICK, f"recipe={name}", "training.max_steps=2", "training.save_every=0", f"hydra.run.dir={run_dir}"],
        tmp_path,
    )
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [0, 1]
    assert all(math.isfinite(r["loss"]) for r in records)


@pytest.mark.slow
def test_the_recipes_campaign_plans_one_condition_per_recipe(tmp_path: Path) -> None:
    """`retrain explain -m +campaign=recipes`: the preset's recipes × seeds, named per recipe, one run dir each."""
    import json

    present = ",".join(name for name in ["grpo", "dr_grpo", "gspo", "cispo", "dapo"] if name in RECIPES)
    result = run_cli(
        ["explain", "-m", "+campaign=recipes", "experiment=quickstart", f"recipe={present}", "--json"], cwd=tmp_path
    )
    report = json.loads(result.stdout)
    names = present.split(",")
    expected = [f"{PAPER_ADVANTAGE.get(n, '')} recipe={n}" for n in names for _ in (42, 101, 202)]
    runs = report["runs"]
    assert [r["seed"] for r in runs] == [42, 101, 202] * len(names)
    for run, label, name in zip(runs, expected, [n for n in names for _ in range(3)]):
        if name in PAPER_ADVANTAGE:
            assert run["condition"] == label
        assert run["condition"].endswith(f"recipe={name}")
        assert Path(run["run_dir"]).name == f"{run['condition'].split()[0]}_s{run['seed']}_{name}"
    assert len(report["conditions"]) == len(names)


def test_the_recipes_campaign_sweeps_every_recipe_by_three_seeds() -> None:
    params = compose(["+campaign=recipes"], return_hydra_config=True).hydra.sweeper.params
    assert (params.recipe, params["training.seed"]) == ("grpo,dr_grpo,gspo,cispo,dapo", "42,101,202")
