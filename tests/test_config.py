"""Every option of every group and sub-group of conf/ composes, and its `_target_`s accept their arguments;
every experiment preset runs.

Nothing here loads a model: targets are resolved and their signatures bound, not called (the slow test
at the end runs each experiment preset for two steps through the real CLI).
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from pathlib import Path
from typing import Any

import pytest
from hydra.utils import get_object
from omegaconf import DictConfig, OmegaConf

from retrain.config import compose, config_groups
from retrain.plugins import is_built_in
from tests.conftest import read_metrics, run_cli

GROUPS = ["backend", "model", "algorithm", "inference", "reward", "data"]
APPENDED = {"campaign"}  # groups outside the primary config's defaults list: added with `+`
HYDRA_PARTS = ["launcher", "sweeper", "callbacks"]  # the parts of the hydra node retrain configures
# arguments the composition root (retrain/run.py) passes at instantiate time
RUNTIME_KWARGS = {
    "backend": {"model": None, "optim": None, "loss": None, "seed": 0},
    "data": {"seed": 0},
}
OPTIONS = [(group, option) for group, options in config_groups().items() for option in options]


def check_targets(node: Any, runtime: dict, where: str) -> int:
    """Bind every `_target_` in `node` (recursively) to its configured arguments; returns how many."""
    if isinstance(node, DictConfig):
        node = OmegaConf.to_container(node, resolve=False)  # interpolations are arguments too, as written
    if not isinstance(node, dict):
        return 0
    checked = sum(check_targets(child, {}, f"{where}.{key}") for key, child in node.items())
    if "_target_" not in node:
        return checked
    target = get_object(node["_target_"])
    kwargs = {k: v for k, v in node.items() if not str(k).startswith("_")}
    signature = inspect.signature(target)
    if is_built_in(target) and isinstance(target, type) and "config" in signature.parameters:
        schema = typing.get_type_hints(target.__init__)["config"]  # a built-in takes its schema's object
        unknown = set(kwargs) - {field.name for field in dataclasses.fields(schema)}
        assert not unknown, f"{where}: {node['_target_']} has no settings {sorted(unknown)} in {schema.__name__}"
        (signature.bind_partial if node.get("_partial_", False) else signature.bind)(schema, **runtime)
        return checked + 1
    try:
        if node.get("_partial_", False):
            signature.bind_partial(**kwargs)
        else:
            signature.bind(**kwargs, **runtime)
    except TypeError as error:
        raise AssertionError(f"{where}: {node['_target_']} does not accept {sorted(kwargs)}: {error}") from error
    return checked + 1


def test_every_group_and_sub_group_of_conf_is_listed():
    groups = config_groups()
    assert set(GROUPS) | {
        "algorithm/advantage",
        "algorithm/transforms",
        "campaign",
        "experiment",
        "hydra/launcher",
    } <= set(groups)
    assert groups["hydra/launcher"] == ["local", "slurm"] and "maxrl_gtpo_sepa" in groups["algorithm"]


@pytest.mark.parametrize("group, option", OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_option_composes_and_binds(group: str, option: str) -> None:
    cfg = compose([f"{'+' if group in APPENDED else ''}{group}={option}"], return_hydra_config=True)
    assert cfg.hydra.runtime.choices[group] == option
    checked = sum(check_targets(cfg[g], RUNTIME_KWARGS.get(g, {}), f"{group}={option}: {g}") for g in GROUPS)
    checked += sum(
        check_targets(cfg.hydra[part], {}, f"{group}={option}: hydra.{part}")
        for part in HYDRA_PARTS
        if cfg.hydra[part] is not None
    )
    assert checked >= len(GROUPS)
    job = OmegaConf.masked_copy(cfg, [key for key in cfg if key != "hydra"])
    OmegaConf.to_container(job, resolve=True)  # every interpolation resolves
    name = cfg.algorithm.name
    assert cfg.hydra.run.dir.endswith(f"_{name}") and cfg.hydra.sweep.subdir == f"{name}_s{cfg.training.seed}"


@pytest.mark.slow
def test_every_experiment_preset_runs_two_steps(tmp_path: Path) -> None:
    """lightning-hydra-template's habit: `-m experiment=glob(*)`, each preset for a couple of steps."""
    sweep = tmp_path / "sweep"
    run_cli(
        [
            "--multirun",
            "experiment=glob(*)",
            "training.max_steps=2",
            "eval.num_examples=0",
            "logging.progress_bar=false",
            f"hydra.sweep.dir={sweep}",
            "hydra.sweep.subdir=${hydra:runtime.choices.experiment}",
        ],
        cwd=tmp_path,
    )
    for preset in config_groups()["experiment"]:
        assert [r["step"] for r in read_metrics(sweep / preset)] == [0, 1], preset


def test_defaults_equal_the_seeds() -> None:
    cfg = compose()
    t = cfg.training
    assert (t.seed, t.max_steps, t.batch_size, t.group_size, t.max_tokens) == (-1, 500, 8, 16, 10240)
    assert (t.temperature, t.top_p, t.lr, t.weight_decay, list(t.betas)) == (0.7, 0.95, 4e-5, 0.0, [0.9, 0.95])
    assert t.save_every == 20
    assert cfg.model.name_or_path == "Qwen/Qwen3-4B-Instruct-2507"
    assert cfg.model.lora_rank == 32 and cfg.model.lora_dropout == 0.0
    assert cfg.algorithm.name == "maxrl_gtpo_sepa"
    assert cfg.reward._target_.endswith("match_reward")
    assert "hendrycks_math" in cfg.data.path


def test_unknown_key_wrong_type_and_unknown_option_fail_at_compose_time() -> None:
    with pytest.raises(Exception, match="lrr"):
        compose(["training.lrr=1"])
    with pytest.raises(Exception, match="batch_size"):
        compose(["training.batch_size=eight"])
    with pytest.raises(Exception, match="algorithm/no_such_algorithm"):
        compose(["algorithm=no_such_algorithm"])
    with pytest.raises(Exception, match="lora_rnk"):
        compose(["model.lora_rnk=8"])
    with pytest.raises(Exception, match="experiment/quickstrat"):  # not the default run in its place
        compose(["experiment=quickstrat"])


def test_a_mapping_override_replaces_the_verifiers_args() -> None:
    args = compose(["data=verifiers", "data.id=my_taskset", "data.args={split: train, num_tasks: 12}"]).data.args
    assert OmegaConf.to_container(args) == {"split": "train", "num_tasks": 12}
    assert compose(["data=verifiers", "data.id=my_taskset"]).data.args is None  # the environment's own defaults


def test_reference_of_the_default_config_is_current() -> None:
    """docs/default-config.yaml shows every default; a changed default must show up in review."""
    reference = Path(__file__).resolve().parents[1] / "docs" / "default-config.yaml"
    composed = OmegaConf.to_yaml(compose())
    assert reference.read_text() == composed, "the default config changed: regenerate with `retrain man --sync`"
