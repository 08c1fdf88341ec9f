"""What a training backend offers the inference engine that samples beside it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from retrain.model.spec import ModelSpec


@dataclass(frozen=True)
class EngineResources:
    """What a training backend offers the inference engine that samples for it."""

    spec: ModelSpec  # the base model and the adapter's shape
    device: torch.device  # where the backend trains
    model: Any | None = None  # the live training model, for an engine that samples with it (no copy)
    # split mode: the engine samples on its own device while the backend trains, so it must hold its
    # own copy of the weights (the trainer overlaps sampling of step s+1 with training of step s)
    overlap: bool = False
    # the KV cache budget the memory plan set for `inference.kv_cache_gb=0` (automatic); None: the engine
    # takes what its device has free, less a margin
    kv_cache_bytes: int | None = None
