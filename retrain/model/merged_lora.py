"""Plain LoRA linears around PEFT's per-call overhead: merged weights to sample, a lean forward otherwise.

Sampling goes through each LoRA linear layer as one matmul with W + s·B·A, kept beside the untouched W.

PEFT's LoRA layer computes x·Wᵀ + s·(x·Aᵀ)·Bᵀ: besides the base matmul, two thin matmuls, a scale and
an add per layer and token, which cost ~15–30% of CPU sampling (docs/benchmarks.md). While the engine
samples, each such layer instead multiplies by a merged weight built once per weight version (the
tensors' version counters move with every optimizer step, copy or load). PEFT's own merge_adapter
is not used: it adds into W and subtracts again, so W would drift by a rounding error at every step.

Only fp32 layers are merged: in bf16/fp16 the merged weight would be rounded to the base weight's
precision, which drops most of a small LoRA update, so the engine would sample from a policy other
than the one being trained. In fp32 the two paths agree to rounding (log-probs within ~1e-6).
The cost is a second copy of the adapted weights (`inference.merge_lora=false` avoids it).

Training leaves out PEFT's bookkeeping: within `lean_lora(layers)` the layers compute without PEFT's adapter
lookups and four submodule calls per layer (~2% of the tiny model's step). An fp32 model's compute base +
B·A·dropout(x)·s with PEFT's ops in PEFT's order (bit-identical losses and gradients). A bf16/fp16 model's
adapters stay fp32 (the master weights, as PEFT keeps them and AdamW updates them), but its LoRA branch runs in
the compute dtype, A and s·B cast inside the autograd graph, as torch.autocast would: PEFT instead casts each
adapted linear's input to fp32 and adds the fp32 branch to the base output, an fp32 copy of the input (kept for
backward) and an fp32 [tokens, out] sum per linear, about as many bytes moved as the base matmuls themselves.
The losses and gradients are PEFT's within the compute dtype's rounding, and the layer's arithmetic is the
sampler's (below), op for op, the residual after the o and down projections added by the base matmul as there.

Without autograd and dropout (sampling where a layer is not merged, the probe, the trainer's log-prob
passes) a layer is three ops, not PEFT's seven: base(x), x·A, and one addmm adding (x·A)·(s·B), with A and
s·B cast to the compute dtype once per weight version (each op is a kernel launch in a GPU's eager decode
step, a bf16 model's default path; benchmarks/decode_counts.py counts them); a residual connection after
one (`plus_linear`) is added by its base matmul, one op fewer. Those are PEFT's outputs within the compute
dtype's rounding (fp32: the scale applied to B rather than to the product, the residual added first; bf16:
the LoRA term in bf16 where PEFT keeps it in fp32 until the sum), never to the bit.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from peft.tuners.lora.layer import Linear as LoraLinear

WeightKey = tuple[int, ...]

# LoRA linear -> (key of A, B, dtype and scale; A and s·B in the base weight's dtype), see _inference_adapter
_adapters: weakref.WeakKeyDictionary[Any, tuple[tuple[Any, ...], torch.Tensor, torch.Tensor]] = (
    weakref.WeakKeyDictionary()
)


class MergedLora:
    """The model's mergeable LoRA linears and their merged weights; `serving()` routes them through those."""

    def __init__(self, layers: list[Any]) -> None:
        self.layers = layers
        self._merged: dict[int, tuple[WeightKey, torch.Tensor]] = {}

    @contextmanager
    def serving(self) -> Iterator[None]:
        """Within the block (inference only: no autograd through the merged weight, no weight changes),
        the layers that serve their single adapter use its merged weight, looked up once on entry."""
        with _routed(self.layers, lambda layer: partial(_merged_forward, layer, self._weight(layer))):
            yield

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


@contextmanager
def lean_lora(layers: list[Any]) -> Iterator[None]:
    """Within the block, the plain LoRA linears (`plain_lora_layers`) compute through `_lean_forward`."""
    with _routed(layers, lambda layer: partial(_lean_forward, layer)):
        yield


@contextmanager
def _routed(layers: list[Any], forward: Callable[[Any], Callable[..., torch.Tensor]]) -> Iterator[None]:
    """The layers that serve their single adapter call `forward(layer)` instead of PEFT's forward."""
    routed = [layer for layer in layers if _serves_default_adapter(layer)]
    for layer in routed:  # an instance attribute shadows the class's forward
        layer.forward = forward(layer)
    try:
        yield
    finally:
        for layer in routed:
            del layer.forward


def _lean_forward(
    layer: Any, x: torch.Tensor, *args: Any, addend: torch.Tensor | None = None, **kwargs: Any
) -> torch.Tensor:
    """PEFT's LoRA forward for one unmerged adapter, op for op, where x and the adapter share a dtype (fp32):
    base(x) + B(A(dropout(x)))·s. Without autograd and dropout, `_inference_forward`'s three ops; under autograd
    with an fp32 adapter on a bf16/fp16 model, `_compute_dtype_forward`. `addend` (`plus_linear`) is added to the
    output: by the base matmul in those two, after PEFT's sum in the first (transformers' order: its bits)."""
    if args or kwargs:
        return LoraLinear.forward(layer, x, *args, **kwargs)
    if not torch.is_grad_enabled() and _no_dropout(layer):
        return _inference_forward(layer, x, addend)
    lora_a, lora_b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    if x.dtype != lora_a.dtype:
        return _compute_dtype_forward(layer, x, addend)
    base = F.linear(x, layer.base_layer.weight, layer.base_layer.bias)
    lora = F.linear(F.linear(layer.lora_dropout["default"](x), lora_a), lora_b)
    out = base + lora * layer.scaling["default"]
    return out if addend is None else addend + out


def _compute_dtype_forward(layer: Any, x: torch.Tensor, addend: torch.Tensor | None = None) -> torch.Tensor:
    """base(x) + (dropout(x)·A)·(s·B) with A and s·B cast to x's dtype inside the autograd graph (fp32 master
    weights, their gradients summed back in fp32 through the casts; what torch.autocast does with a matmul): no
    fp32 copy of x and no fp32 [tokens, out] sum per layer, which PEFT makes (its casts moved about as many bytes
    as the base matmuls), and the sampler's arithmetic (`_inference_forward`) op for op, the adds fused into the
    matmuls (an addmm passes its output's gradient to its addend as is: no op in backward either)."""
    lora_a, lora_b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    rows = x.reshape(-1, x.shape[-1])
    base = _base_matmul(layer, rows, addend)
    down = F.linear(layer.lora_dropout["default"](rows), lora_a.to(x.dtype))
    out = torch.addmm(base, down, (lora_b * layer.scaling["default"]).to(x.dtype).t())
    return out.view(*x.shape[:-1], out.shape[-1])


def plus_linear(layer: Any, x: torch.Tensor, addend: torch.Tensor) -> torch.Tensor:
    """addend + layer(x) (a residual connection): where `layer` is a lean LoRA linear without bias, the addend goes
    into its base matmul wherever `_lean_forward` computes in the compute dtype (sampling, and training a bf16/fp16
    model), one op fewer."""
    forward = vars(layer).get("forward")
    lean = isinstance(forward, partial) and forward.func is _lean_forward
    if not lean or layer.base_layer.bias is not None:
        return addend + layer(x)
    return _lean_forward(layer, x, addend=addend)


def _inference_forward(layer: Any, x: torch.Tensor, addend: torch.Tensor | None = None) -> torch.Tensor:
    """base(x) + (x·A)·(s·B) in the base weight's dtype, the add fused into the second matmul: three kernels where
    PEFT's forward launches seven (two casts, a scale and an add). Within the compute dtype's rounding of PEFT's.
    An `addend` of the output's shape (`plus_linear`; the base layer has no bias) is added by the base matmul."""
    lora_a, scaled_b = _inference_adapter(layer)
    rows = x.reshape(-1, x.shape[-1])
    out = torch.addmm(_base_matmul(layer, rows, addend), F.linear(rows, lora_a), scaled_b.t())
    return out.view(*x.shape[:-1], out.shape[-1])


def _base_matmul(layer: Any, rows: torch.Tensor, addend: torch.Tensor | None) -> torch.Tensor:
    """The base layer's output for [tokens, in] rows, plus `addend` (then the layer has no bias) in the same op."""
    weight = layer.base_layer.weight
    if addend is None:
        return F.linear(rows, weight, layer.base_layer.bias)
    return torch.addmm(addend.reshape(rows.shape[0], -1), rows, weight.t())


def _inference_adapter(layer: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """A and s·B in the base weight's dtype, rebuilt when A, B or s changed (an optimizer step, a copy or a load
    moves a tensor's version), so that no step casts or scales them."""
    lora_a, lora_b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    dtype, scale = layer.base_layer.weight.dtype, layer.scaling["default"]
    if torch.compiler.is_compiling():  # a compiled step: the casts are in its graph (a pointer check cannot be)
        return lora_a.to(dtype), (lora_b * scale).to(dtype)
    key = (lora_a.data_ptr(), lora_a._version, lora_b.data_ptr(), lora_b._version, dtype, scale)
    cached = _adapters.get(layer)
    if cached is None or cached[0] != key:
        with torch.no_grad():
            cached = _adapters[layer] = (key, lora_a.to(dtype), (lora_b * scale).to(dtype))
    return cached[1], cached[2]


def _no_dropout(layer: Any) -> bool:
    dropout = layer.lora_dropout["default"]
    return isinstance(dropout, torch.nn.Identity) or not dropout.training or dropout.p == 0


def _merged_forward(layer: Any, weight: torch.Tensor, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    if args or kwargs:  # PEFT's per-call options (e.g. adapter_names): its own path
        return LoraLinear.forward(layer, x, *args, **kwargs)
    return F.linear(x, weight, layer.base_layer.bias)


def _serves_default_adapter(layer: Any) -> bool:
    """PEFT would apply exactly the "default" adapter, unmerged (not disabled, merged or switched), casting
    the input to the adapter's dtype (peft.helpers.disable_input_dtype_casting not in force)."""
    return (
        not layer.disable_adapters
        and not layer.merged
        and layer.active_adapters == ["default"]
        and getattr(layer, "cast_input_dtype_enabled", True)
    )


def merged_lora(layers: list[Any]) -> MergedLora | None:
    """A MergedLora over the fp32 ones of these plain LoRA linears, or None when there are none."""
    mergeable = [layer for layer in layers if _all_fp32(layer)]
    return MergedLora(mergeable) if mergeable else None


def plain_lora_layers(model: torch.nn.Module) -> list[Any]:
    """The model's plain LoRA linears: PEFT LoRA over an nn.Linear with one adapter named "default",
    no DoRA-style variant and no LoRA bias (not part of W + s·B·A)."""
    return [module for module in model.modules() if _plain_lora(module)]


def _plain_lora(module: torch.nn.Module) -> bool:
    if not isinstance(module, LoraLinear) or not isinstance(module.base_layer, torch.nn.Linear):
        return False
    return (
        list(module.lora_A.keys()) == ["default"]
        and not module.lora_variant
        and not module.fan_in_fan_out
        and module.lora_B["default"].bias is None
    )


def _all_fp32(layer: Any) -> bool:
    return layer.base_layer.weight.dtype == torch.float32 and layer.lora_A["default"].weight.dtype == torch.float32


def merged_checkpoint(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The PEFT-wrapped model's weights under their checkpoint names (PEFT's `base_layer` taken out), each plain
    LoRA linear's weight merged as W + s·B·A in fp32: what an engine that serves no adapter loads (vLLM with
    `inference.merge_lora`). Every trainable weight must belong to a plain LoRA linear (`mergeable_adapter`)."""
    base = model.get_base_model()  # type: ignore[operator]
    merged = {f"{name}.base_layer.weight": module for name, module in base.named_modules() if _plain_lora(module)}
    weights = []
    with torch.no_grad():
        for name, parameter in base.named_parameters():
            if ".lora_" in name:
                continue
            layer = merged.get(name)
            if layer is not None:
                lora_a, lora_b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
                tensor = torch.addmm(parameter.float(), lora_b.float(), lora_a.float(), alpha=layer.scaling["default"])
            else:
                tensor = parameter.detach()
            weights.append((name.replace(".base_layer.", "."), tensor))
    return weights


def mergeable_adapter(model: torch.nn.Module) -> bool:
    """Every trainable weight is the A or B of a plain LoRA linear that serves its one adapter unmerged."""
    lora = {id(p) for layer in plain_lora_layers(model) if _serves_default_adapter(layer) for p in layer.parameters()}
    return all(id(p) in lora for p in model.parameters() if p.requires_grad)
