"""Each default is written once: in the schema of its group. YAML options hold only what differs,
and constructors agree with the schema (they read their defaults from it)."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import pytest
import yaml
from hydra.utils import get_object
from omegaconf import OmegaConf

from retrain.backend.settings import LossSettings, OptimSettings
from retrain.config import GROUP_SCHEMA_MODULES, TrainingConfig, config_dir

GROUPS = ["backend", "model", "inference", "reward", "data"]
OPTIONS = [(group, path) for group in GROUPS for path in sorted((Path(config_dir()) / group).glob("*.yaml"))]


def schema_of(group: str, option: dict) -> type:
    schemas = importlib.import_module(GROUP_SCHEMA_MODULES[group]).SCHEMAS
    (base,) = [entry for entry in option["defaults"] if isinstance(entry, str) and entry in schemas]
    return schemas[base]


@pytest.mark.parametrize(("group", "path"), OPTIONS, ids=[f"{g}/{p.stem}" for g, p in OPTIONS])
def test_an_option_sets_only_what_differs_from_its_schema(group: str, path: Path) -> None:
    option = yaml.safe_load(path.read_text())
    defaults = OmegaConf.structured(schema_of(group, option))
    repeated = [key for key, value in option.items() if key != "defaults" and defaults.get(key) == value]
    assert not repeated, f"conf/{group}/{path.name} repeats its schema's defaults for {repeated}"


@pytest.mark.parametrize(("group", "path"), OPTIONS, ids=[f"{g}/{p.stem}" for g, p in OPTIONS])
def test_a_constructor_defaults_agree_with_its_schema(group: str, path: Path) -> None:
    schema = schema_of(group, yaml.safe_load(path.read_text()))
    defaults = OmegaConf.to_container(OmegaConf.structured(schema))
    target = get_object(defaults["_target_"])
    if target is schema:  # the schema is the value (ModelSpec): one definition by construction
        return
    parameters = inspect.signature(target).parameters
    for key, value in defaults.items():
        if key in parameters and parameters[key].default is not inspect.Parameter.empty:
            default = parameters[key].default
            assert (list(default) if isinstance(default, tuple) else default) == value, f"{defaults['_target_']}: {key}"


def test_the_optimiser_and_loss_settings_come_from_the_training_schema() -> None:
    training = TrainingConfig()
    optim, loss = OptimSettings.from_config(training), LossSettings.from_config(training)
    assert (optim.lr, optim.weight_decay, list(optim.betas), optim.eps, optim.max_grad_norm) == (
        training.lr,
        training.weight_decay,
        training.betas,
        training.eps,
        training.max_grad_norm,
    )
    assert (loss.clip_eps, loss.clip_eps_high, loss.upper_eps) == (0.0, None, 0.0)
    assert LossSettings.from_config(TrainingConfig(clip_eps=0.2)).upper_eps == 0.2  # clip_eps_high None = clip_eps
