"""Each default is written once: in the schema of its group. YAML options hold only what differs, and
built-in parts take the schema's object instead of repeating its fields."""

from __future__ import annotations

import dataclasses
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
def test_a_built_in_takes_its_schema_object_and_repeats_none_of_its_fields(group: str, path: Path) -> None:
    """The schema is the only owner of its fields: a built-in class takes the schema's object (keywords are converted
    into it once, retrain.settings_object), never the fields again as keyword arguments with defaults of their own."""
    schema = schema_of(group, yaml.safe_load(path.read_text()))
    target = get_object(OmegaConf.to_container(OmegaConf.structured(schema))["_target_"])
    if target is schema or not isinstance(target, type):  # ModelSpec is its own value; a reward function takes kwargs
        return
    parameters = inspect.signature(target).parameters
    assert next(iter(parameters.values())).annotation in (schema.__name__, schema), f"{target} does not take {schema}"
    repeated = {f.name for f in dataclasses.fields(schema)} & set(parameters)
    assert not repeated, f"{target.__qualname__} repeats {sorted(repeated)} of {schema.__name__}"


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
