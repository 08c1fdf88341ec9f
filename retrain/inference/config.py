"""Schemas of the `inference` config group (conf/inference/*.yaml).

Every engine is a partial, completed by the composition root as
`engine(tokenizer=<the run's tokenizer>, resources=backend.engine_resources())`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PytorchEngineConfig:
    """In-process engine on the training model itself (no second copy of the weights)."""

    _target_: str = "retrain.inference.pytorch.PytorchEngine"
    _partial_: bool = True
    prefix_caching: bool = True  # prefill each prompt once and repeat its KV cache G times


SCHEMAS: dict[str, type] = {"base_pytorch": PytorchEngineConfig}
