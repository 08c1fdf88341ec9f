"""Schemas of the `inference` config group (conf/inference/*.yaml)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PytorchEngineConfig:
    """In-process engine on the training model. A partial: the backend supplies model, tokenizer, device."""

    _target_: str = "retrain.inference.pytorch.PytorchEngine"
    _partial_: bool = True
    prefix_caching: bool = True  # prefill each prompt once and repeat its KV cache G times


SCHEMAS: dict[str, type] = {"base_pytorch": PytorchEngineConfig}
