"""Every option of every group and every preset composes, and its `_target_` accepts its arguments.

Nothing here loads a model: targets are resolved and their signatures bound, not called.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
from hydra.utils import get_object
from omegaconf import DictConfig, OmegaConf

from retrain.config import compose, config_dir

CONF = Path(config_dir())
GROUPS = ["backend", "model", "algorithm", "inference", "reward", "data"]
# arguments the composition root (retrain/run.py) passes at instantiate time
RUNTIME_KWARGS = {
    "backend": {"model": None, "engine": None, "optim": None, "loss": None, "seed": 0},
    "data": {"seed": 0},
}


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def check_targets(node: DictConfig, runtime: dict, where: str) -> int:
    """Bind every `_target_` in `node` (recursively) to its configured arguments; returns how many."""
    checked = 0
    for key, child in node.items():
        if isinstance(child, DictConfig):
            checked += check_targets(child, {}, f"{where}.{key}")
    if "_target_" not in node:
        return checked
    target = get_object(node._target_)
    kwargs = {k: v for k, v in node.items() if not str(k).startswith("_")}
    signature = inspect.signature(target)
    try:
        if node.get("_partial_", False):
            signature.bind_partial(**kwargs)
        else:
            signature.bind(**kwargs, **runtime)
    except TypeError as error:
        raise AssertionError(f"{where}: {node._target_} does not accept {sorted(kwargs)}: {error}")
    return checked + 1


@pytest.mark.parametrize("group", GROUPS)
def test_every_option_of_every_group_composes_and_binds(group: str) -> None:
    found = options(group)
    assert found, f"conf/{group}/ has no options"
    for option in found:
        cfg = compose([f"{group}={option}"])
        assert "_target_" in cfg[group], f"{group}={option} has no _target_"
        assert check_targets(cfg[group], RUNTIME_KWARGS.get(group, {}), f"{group}={option}") >= 1


@pytest.mark.parametrize("preset", options("experiment"))
def test_every_experiment_preset_composes_and_binds(preset: str) -> None:
    cfg = compose([f"experiment={preset}"])
    for group in GROUPS:
        check_targets(cfg[group], RUNTIME_KWARGS.get(group, {}), f"experiment={preset}: {group}")
    OmegaConf.to_container(cfg, resolve=True)  # every interpolation resolves


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


def test_reference_of_the_default_config_is_current() -> None:
    """docs/default-config.yaml shows every default; a changed default must show up in review."""
    reference = Path(__file__).resolve().parents[1] / "docs" / "default-config.yaml"
    composed = OmegaConf.to_yaml(compose())
    assert reference.read_text() == composed, (
        "the default config changed: regenerate with `python -m retrain --cfg job > docs/default-config.yaml`")
