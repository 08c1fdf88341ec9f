"""Fixtures of the backend=tinker tests: the fake SDK put in place of `tinker` (the SDK boundary: the
backend imports it lazily), a valid key in TINKER_API_KEY, and a private slot-lock directory."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from retrain.backend.settings import LossSettings, OptimSettings
from retrain.backend.tinker.backend import TinkerBackend
from retrain.backend.tinker.config import TinkerBackendConfig
from retrain.model.spec import ModelSpec
from tests.backend.fake_tinker import FakeService, fake_sdk

FAKE_KEY = "tml-fake-key"
OPTIM = OptimSettings(lr=0.05, weight_decay=0.01, betas=(0.9, 0.99), eps=1e-8, max_grad_norm=1.0)
IS_LOSS = LossSettings(clip_eps=0.0, clip_eps_high=None)


@pytest.fixture
def service(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[FakeService]:
    """A fake Tinker service behind a fake `tinker` module; TINKER_API_KEY holds a key it accepts."""
    fake = FakeService()
    monkeypatch.setitem(sys.modules, "tinker", fake_sdk(fake))
    monkeypatch.setenv("TINKER_API_KEY", FAKE_KEY)
    monkeypatch.delenv("TINKER_BASE_URL", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # default lock_dir lands in the test's tmp
    yield fake


def make_backend(loss: LossSettings = IS_LOSS, seed: int = 3, **options: Any) -> TinkerBackend:
    """A backend on the bundled tiny model's name (the fake serves it), retrying without delay."""
    return TinkerBackend(
        TinkerBackendConfig(**{"retry_backoff_s": 0.0, **options}),
        model=ModelSpec(name_or_path="retrain:tiny_qwen3", lora_rank=8),
        optim=OPTIM,
        loss=loss,
        seed=seed,
    )


@pytest.fixture(scope="session")
def tiny_tokenizer() -> Any:
    return ModelSpec(name_or_path="retrain:tiny_qwen3").load_tokenizer()


def token_advantages(rollouts: Any, per_row: list[float]) -> torch.Tensor:
    """[N, T] advantages: each row's value on its completion tokens, 0 on padding."""
    return torch.tensor(per_row, dtype=torch.float32)[:, None] * rollouts.completion_mask.float()
