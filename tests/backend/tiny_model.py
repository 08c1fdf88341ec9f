"""The tiny causal LM that backend and engine tests run on: the Qwen3 bundled with retrain
(retrain/assets/tiny_qwen3, ~0.8M params, byte-level tokenizer, ChatML template), loaded from its
directory through the same code path as any local model, and wired as the composition root wires it."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest

from retrain.assets import TINY_MODEL_DIR
from retrain.backend.config import LocalBackendConfig
from retrain.backend.local import LocalBackend
from retrain.backend.settings import LossSettings, OptimSettings
from retrain.config import TrainingConfig
from retrain.inference.config import PytorchEngineConfig
from retrain.inference.pytorch import PytorchEngine
from retrain.model.spec import ChatPrompts, ModelSpec

PROMPTS = ["What is 12+35?", "What is 7+8?", "What is 40+2?", "What is 99+1?"]


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    return TINY_MODEL_DIR


@pytest.fixture
def tiny_spec() -> ModelSpec:
    return ModelSpec(name_or_path="retrain:tiny_qwen3", lora_rank=4)


@functools.cache
def tokenizer_of(name_or_path: str) -> Any:
    return ModelSpec(name_or_path=name_or_path).load_tokenizer()


def make_backend(
    spec: ModelSpec,
    seed: int = 0,
    lr: float = 1e-2,
    max_grad_norm: float = 1.0,
    loss: LossSettings | None = None,
    devices: str = "cpu",
    micro_batch_tokens: int = 0,
    optim: OptimSettings | None = None,
    **options,
) -> LocalBackend:
    """A CPU LocalBackend with the run-wide defaults but `lr` and `max_grad_norm` (or all of `optim`)."""
    training = TrainingConfig(lr=lr, max_grad_norm=max_grad_norm)
    return LocalBackend(
        LocalBackendConfig(devices=devices, micro_batch_tokens=micro_batch_tokens, **options),
        model=spec,
        optim=optim or OptimSettings.from_config(training),
        loss=loss or LossSettings.from_config(training),
        seed=seed,
    )


def make_engine(backend: LocalBackend, **options) -> PytorchEngine:
    """The in-process engine beside `backend`, sampling with its model."""
    return PytorchEngine(
        PytorchEngineConfig(**options),
        tokenizer=tokenizer_of(backend.spec.name_or_path),
        resources=backend.engine_resources(),
    )


def encode(backend: LocalBackend, prompts: list[str]) -> list[list[int]]:
    return ChatPrompts(tokenizer_of(backend.spec.name_or_path), backend.spec.name_or_path)(prompts)
