"""Schemas of the `backend` and `model` config groups (conf/backend/*.yaml, conf/model/*.yaml).

Model schemas are named `base_model*` so the ConfigStore registration routes them to `model`. The
model's schema is `ModelSpec` itself: the dataclass the option instantiates.
"""

from __future__ import annotations

from dataclasses import dataclass

from retrain.backend.model import ModelSpec


@dataclass
class LocalBackendConfig:
    """PyTorch/PEFT training on this machine; the model, optimiser and loss settings and the seed come
    from the composition root at instantiate time."""

    _target_: str = "retrain.backend.local.LocalBackend"
    # "cpu" or "gpu:N" (CPU fallback with a warning when CUDA is absent); split mode "gpu:I,gpu:T":
    # inference on the first, training on the last, sampling of step s+1 overlapping training of step s
    devices: str = "gpu:0"
    micro_batch_size: int = 2  # rows per forward/backward (bounds activation memory); 0 = all rows at once
    gradient_checkpointing: bool = False  # recompute activations in backward: less memory, ~30% slower


SCHEMAS: dict[str, type] = {"base_local": LocalBackendConfig, "base_model": ModelSpec}
