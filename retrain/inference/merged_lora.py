"""Sampling through each LoRA linear layer as one matmul with W + s·B·A, kept beside the untouched W.

PEFT's LoRA layer computes x·Wᵀ + s·(x·Aᵀ)·Bᵀ: besides the base matmul, two thin matmuls, a scale and
an add per layer and token, which cost ~15–30% of CPU sampling (docs/benchmarks.md). While the engine
samples, each such layer instead multiplies by a merged weight built once per weight version (the
tensors' version counters move with every optimizer step, copy or load). PEFT's own merge_adapter
is not used: it adds into W and subtracts again, so W would drift by a rounding error at every step.

Only fp32 layers are merged: in bf16/fp16 the merged weight would be rounded to the base weight's
precision, which drops most of a small LoRA update, so the engine would sample from a policy other
than the one being trained. In fp32 the two paths agree to rounding (log-probs within ~1e-6).
The cost is a second copy of the adapted weights (`inference.merge_lora=false` avoids it).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from peft.tuners.lora.layer import Linear as LoraLinear

WeightKey = tuple[int, ...]


class MergedLora:
    """The model's mergeable LoRA linears and their merged weights; `serving()` routes them through those."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.layers: list[Any] = [module for module in model.modules() if _mergeable(module)]  # PEFT's LoraLinear
        self._merged: dict[int, tuple[WeightKey, torch.Tensor]] = {}

    @contextmanager
    def serving(self) -> Iterator[None]:
        """Within the block (inference only: no autograd through the merged weight, no weight changes),
        the layers that serve their single adapter use its merged weight, looked up once on entry."""
        routed = [layer for layer in self.layers if _serves_default_adapter(layer)]
        for layer in routed:  # an instance attribute shadows the class's forward
            layer.forward = partial(_merged_forward, layer, self._weight(layer))
        try:
            yield
        finally:
            for layer in routed:
                del layer.forward

    def _weight(self, layer: Any) -> torch.Tensor:
        """W + s·B·A for the layer's current tensors, rebuilt when any of them changed."""
        base, lora_a, lora_b = layer.base_layer.weight, layer.lora_A["default"].weight, layer.lora_B["default"].weight
        key = tuple(value for t in (base, lora_a, lora_b) for value in (t.data_ptr(), t._version))
        cached = self._merged.get(id(layer))
        if cached is None or cached[0] != key:
            with torch.no_grad():
                merged = torch.addmm(base, lora_b, lora_a, alpha=layer.scaling["default"])
            cached = self._merged[id(layer)] = (key, merged)
        return cached[1]


def _merged_forward(layer: Any, weight: torch.Tensor, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    if args or kwargs:  # PEFT's per-call options (e.g. adapter_names): its own path
        return LoraLinear.forward(layer, x, *args, **kwargs)
    return F.linear(x, weight, layer.base_layer.bias)


def _serves_default_adapter(layer: Any) -> bool:
    """PEFT would apply exactly the "default" adapter, unmerged (not disabled, merged or switched)."""
    return not layer.disable_adapters and not layer.merged and layer.active_adapters == ["default"]


def merged_lora(model: torch.nn.Module) -> MergedLora | None:
    """A MergedLora over the model's fp32 single-adapter LoRA linears, or None when it has none."""
    merged = MergedLora(model)
    return merged if merged.layers else None


def _mergeable(module: torch.nn.Module) -> bool:
    """A plain LoRA linear (one adapter named "default", no DoRA-style variant) over an fp32 nn.Linear."""
    if not isinstance(module, LoraLinear) or not isinstance(module.base_layer, torch.nn.Linear):
        return False
    return (
        list(module.lora_A.keys()) == ["default"]
        and not module.lora_variant
        and not module.fan_in_fan_out
        and module.base_layer.weight.dtype == torch.float32
        and module.lora_A["default"].weight.dtype == torch.float32
    )
