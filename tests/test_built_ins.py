"""Every part retrain ships is marked as its own: a built-in wrapped as a plugin would say "raised in the plugin"."""

from __future__ import annotations

import dataclasses
import importlib
from pathlib import Path

import pytest
from hydra.utils import get_object
from omegaconf import OmegaConf

from retrain.config import GROUP_SCHEMA_MODULES, config_dir
from retrain.plugins import checked, is_built_in


def _targets(node: object, hydra_node: bool = False) -> set[str]:
    """`_target_` values naming retrain objects anywhere in a YAML tree, Hydra's own settings left out
    (a Hydra callback is Hydra's part, not one of a run's)."""
    found: set[str] = set()
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "_target_" and isinstance(value, str) and value.startswith("retrain.") and not hydra_node:
                found.add(value)
            found |= _targets(value, hydra_node or key == "hydra")
    elif isinstance(node, list):
        for value in node:
            found |= _targets(value, hydra_node)
    return found


def _conf_targets() -> set[str]:
    targets: set[str] = set()
    for path in Path(config_dir()).rglob("*.yaml"):
        targets |= _targets(OmegaConf.to_container(OmegaConf.load(path), resolve=False))
    for module in set(GROUP_SCHEMA_MODULES.values()):
        for schema in importlib.import_module(module).SCHEMAS.values():
            targets |= {f.default for f in dataclasses.fields(schema) if f.name == "_target_"}
    return targets


CONF_TARGETS = sorted(_conf_targets())


def test_conf_names_the_parts_of_every_group() -> None:
    """The scan finds what it should (an empty scan would pass the test below vacuously)."""
    assert {"retrain.backend.tinker.backend.TinkerBackend", "retrain.inference.pytorch.PytorchEngine"} <= set(
        CONF_TARGETS
    )
    assert len(CONF_TARGETS) >= 25


@pytest.mark.parametrize("target", CONF_TARGETS)
def test_every_conf_target_of_ours_is_built_in(target: str) -> None:
    part = get_object(target)
    assert is_built_in(part), f"{target} is not marked @built_in"
    assert checked(part, {}, target) is part  # so it is never wrapped as a plugin
