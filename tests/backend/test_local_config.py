"""conf/backend/local.yaml, conf/model/*.yaml and conf/inference/pytorch.yaml build working parts,
the way the composition root builds them."""

from __future__ import annotations

import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf

from retrain.backend.local import LocalBackend
from retrain.backend.settings import LossSettings, OptimSettings
from retrain.config import TrainingConfig, compose
from retrain.errors import ConfigError
from retrain.inference.pytorch import PytorchEngine
from retrain.model.spec import ModelSpec
from retrain.run import build_part
from tests.backend.tiny_model import tokenizer_of

SETTINGS = {"optim": OptimSettings.from_config(TrainingConfig()), "loss": LossSettings.from_config(TrainingConfig())}


def test_default_model_is_qwen3_4b_with_rank_32_and_auto_alpha():
    spec = instantiate(compose([]).model)
    assert isinstance(spec, ModelSpec)
    assert spec.name_or_path == "Qwen/Qwen3-4B-Instruct-2507"
    assert (spec.lora_rank, spec.effective_alpha, spec.lora_dropout) == (32, 64, 0.0)
    assert "q_proj" in spec.target_modules and "down_proj" in spec.target_modules


def test_the_schema_is_the_model_spec_so_its_defaults_are_written_once():
    composed = compose([]).model
    assert instantiate(composed) == ModelSpec() == OmegaConf.to_object(composed)
    tiny = instantiate(compose(["model=tiny"]).model)
    assert tiny == ModelSpec(name_or_path="retrain:tiny_qwen3", lora_rank=8)


def test_model_values_are_type_checked_at_compose_time():
    with pytest.raises(Exception, match="lora_rank"):
        compose(["model.lora_rank=many"])


def test_backend_and_engine_build_from_the_config(tiny_model_dir):
    cfg = compose(
        [
            "backend.devices=cpu",
            f"model.name_or_path={tiny_model_dir}",
            "model.lora_rank=4",
            "inference.prefix_caching=false",
        ]
    )
    backend = build_part(cfg, "backend", model=build_part(cfg, "model"), seed=0, **SETTINGS)
    assert isinstance(backend, LocalBackend)
    assert backend.micro_batch_tokens == cfg.backend.micro_batch_tokens
    tokenizer = tokenizer_of(str(tiny_model_dir))
    engine = build_part(cfg, "inference", tokenizer=tokenizer, resources=backend.engine_resources())
    assert isinstance(engine, PytorchEngine)
    assert engine.prefix_caching is False and engine.model is backend.model  # it shares the weights


def test_bad_value_from_the_config_is_named(tiny_model_dir):
    cfg = compose(["backend.devices='gpu:0,gpu:1'", f"model.name_or_path={tiny_model_dir}"])
    with pytest.raises(ConfigError, match="backend.devices"):
        build_part(cfg, "backend", model=build_part(cfg, "model"), seed=0, **SETTINGS)
