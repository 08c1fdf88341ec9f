"""Hydra's compose-time mistakes, as retrain's one line: composed by the real Hydra, from the real config."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from omegaconf.errors import InterpolationResolutionError

from retrain.config import TrainingConfig, compose
from retrain.config_checks.compose_errors import compose_error_line

TRAINING_KEYS = ", ".join(sorted(field.name for field in fields(TrainingConfig)))  # the schema's, sorted


def composed_mistake(*overrides: str) -> str:
    with pytest.raises(Exception) as raised:
        compose(["experiment=quickstart", *overrides])
    line = compose_error_line(raised.value)
    assert line is not None and "\n" not in line, line
    return line


@pytest.mark.parametrize(
    ("override", "line"),
    [
        ("training.lrr=1", f"unknown config key 'training.lrr'; did you mean 'training.lr'? (known: {TRAINING_KEYS})"),
        ("trainig.lr=1", "unknown config key 'trainig'; did you mean 'training'? (known: algorithm, backend,"),
        ("backend.devicez=cpu", "unknown config key 'backend.devicez'; did you mean 'backend.devices'?"),
        ("algorithm.sepa.step=9", "unknown config key 'algorithm.sepa.step'; did you mean 'algorithm.sepa.steps'?"),
        ("training.colour=red", f"unknown config key 'training.colour' (known: {TRAINING_KEYS})"),
    ],
)
def test_an_unknown_key_is_named_with_the_key_it_most_likely_meant(override: str, line: str) -> None:
    assert composed_mistake(override).startswith(line)


def test_a_replaced_key_names_its_replacement(tmp_path: Path) -> None:
    """`backend.micro_batch_size` (rows) became `backend.micro_batch_tokens` (padded tokens): the old key fails at
    compose time, from an override or from a user's preset, naming the new one and what it counts."""
    line = (
        "config key 'backend.micro_batch_size' was replaced by backend.micro_batch_tokens, which counts padded tokens "
        "(prompt + completion) per forward/backward, not rows (0 = all rows at once, as before)"
    )
    assert composed_mistake("backend.micro_batch_size=2") == line
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "old.yaml").write_text("# @package _global_\nbackend:\n  micro_batch_size: 2\n")
    with pytest.raises(Exception) as raised:
        compose([f"hydra.searchpath=[file://{tmp_path}]", "experiment=old"])
    assert compose_error_line(raised.value) == f"experiment/old: {line}"


def test_a_node_without_a_schema_says_how_to_add_an_argument() -> None:
    """A transform's node holds only its `_target_`: a new argument is a `+`, as Hydra advises there."""
    assert composed_mistake("algorithm.transforms.sepa.lam=1") == (
        "unknown config key 'algorithm.transforms.sepa.lam'; a new argument is added with +algorithm.transforms.sepa.lam=..."
    )


@pytest.mark.parametrize(
    ("override", "line"),
    [
        ("training.lr=fast", "training.lr=fast: Value 'fast' of type 'str' could not be converted to Float"),
        ("model.lora_rank=x", "model.lora_rank=x: Value 'x' of type 'str' could not be converted to Integer"),
    ],
)
def test_a_value_of_the_wrong_type_names_the_override(override: str, line: str) -> None:
    assert composed_mistake(override) == line


def test_a_missing_option_names_the_closest_one() -> None:
    assert composed_mistake("algorithm=maxrl_gtpo_sepaa") == (
        "algorithm=maxrl_gtpo_sepaa: no such option; did you mean maxrl_gtpo_sepa? "
        "(`python -m retrain --help` lists all 30)"
    )
    assert composed_mistake("experiment=quickstrat") == (
        "experiment=quickstrat: no such option; did you mean quickstart? (options: quickstart)"
    )


def test_a_missing_option_with_nothing_close_lists_the_options() -> None:
    line = composed_mistake("inference=zzz")
    assert line.startswith("inference=zzz: no such option (options: ") and "vllm_server" in line


def test_an_override_that_does_not_parse_or_is_ambiguous_reads_as_one_line() -> None:
    assert composed_mistake("training.lr=[1,").startswith(
        "cannot parse the override 'training.lr=[1,': no viable alternative at input '[1,'; See https://hydra.cc/"
    )
    assert composed_mistake("training.lr=1,2").startswith(
        "Ambiguous value for argument 'training.lr=1,2'; 1. To use it as a list, use key=[value1,value2]; "
    )


def test_a_key_a_preset_sets_is_named_with_the_preset() -> None:
    """The CPU demo's preset sets `backend.devices`, which the Tinker backend does not have."""
    assert composed_mistake("backend=tinker").startswith(
        "experiment/quickstart: unknown config key 'backend.devices' (known: base_url, lock_dir,"
    )


def test_a_wrong_value_in_a_users_preset_is_named_with_the_preset(tmp_path: Path) -> None:
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "mine.yaml").write_text("# @package _global_\ntraining:\n  lr: fast\n")
    with pytest.raises(Exception) as raised:
        compose([f"hydra.searchpath=[file://{tmp_path}]", "experiment=mine"])
    assert compose_error_line(raised.value) == (
        "experiment/mine: training.lr: Value 'fast' of type 'str' could not be converted to Float"
    )


def test_other_errors_are_not_compose_mistakes() -> None:
    assert compose_error_line(ValueError("training.lr must be > 0")) is None


def test_an_unresolvable_interpolation_is_hydras_only_in_the_hydra_node() -> None:
    """retrain checks its own keys' interpolations (retrain/config_checks/validation.py); Hydra resolves its run dir itself."""
    config = OmegaConf.create({"hydra": {"run": {"dir": "${nosuch}"}}, "training": {"lr": "${nosuch}"}})
    with pytest.raises(InterpolationResolutionError) as in_hydra:
        str(config.hydra.run.dir)
    assert compose_error_line(in_hydra.value) == (
        "hydra.run.dir: its interpolation cannot be resolved: Interpolation key 'nosuch' not found"
    )
    with pytest.raises(InterpolationResolutionError) as in_training:
        str(config.training.lr)
    assert compose_error_line(in_training.value) is None
