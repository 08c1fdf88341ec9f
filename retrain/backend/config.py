"""Schemas of the `backend` and `model` config groups (conf/backend/*.yaml, conf/model/*.yaml).

Model schemas are named `base_model*` so the ConfigStore registration routes them to `model`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# the attention and MLP projections of Qwen/Llama-style models
DEFAULT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class LocalBackendConfig:
    """PyTorch/PEFT training on this machine; model, engine, optimiser and loss come from the
    composition root at instantiate time."""

    _target_: str = "retrain.backend.local.LocalBackend"
    devices: str = "gpu:0"  # "cpu" or "gpu:N" (CPU fallback with a warning when CUDA is absent)
    micro_batch_size: int = 2  # rows per forward/backward (bounds activation memory); 0 = all rows at once
    gradient_checkpointing: bool = False  # recompute activations in backward: less memory, ~30% slower


@dataclass
class ModelConfig:
    """A causal LM and its LoRA adapter (see retrain.backend.model.ModelSpec)."""

    _target_: str = "retrain.backend.model.ModelSpec"
    name_or_path: str = "Qwen/Qwen3-4B-Instruct-2507"  # Hub id, local dir, or retrain:<bundled asset>
    revision: str | None = None
    lora_rank: int = 32
    lora_alpha: int = 0  # 0 = auto (2 * lora_rank)
    lora_dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: list(DEFAULT_TARGET_MODULES))
    dtype: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | bf16 | fp16 | fp32


SCHEMAS: dict[str, type] = {"base_local": LocalBackendConfig, "base_model": ModelConfig}
