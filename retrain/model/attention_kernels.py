"""`inference.attention_kernel` of the pytorch engine: its kernel names as transformers' attention implementations.

    default  the model's own: sdpa, with retrain's choice of kernels per device (retrain/model/attention.py)
    flash    transformers' "flash_attention_2" (the flash-attn package; CUDA, bf16/fp16 weights)
    triton   transformers' "flex_attention": torch's FlexAttention, compiled into Triton kernels (CUDA; each
             new shape compiles once, so the first steps are slow)
    cutlass  sdpa held to torch's memory-efficient kernel, CUTLASS's fused attention (CUDA)
    tk       refused by the schema: transformers has no ThunderKittens attention

The engine samples with the model the backend trains, so the kernel is swapped in only while it samples
or probes, and training keeps the model's own. Whether a kernel can run is decided when the engine
starts (a GPU, its package, the weights' dtype): refused with a message naming the key, never a silent
fallback to another kernel.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from retrain.errors import ConfigError

KEY = "inference.attention_kernel"  # the setting that names the kernel; its schema checks the name
CUTLASS_SDPA = "retrain_cutlass_sdpa"
HALF_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Kernel:
    """What one kernel name stands for, and what it needs to run."""

    implementation: str  # transformers' attention implementation
    package: str | None = None  # a module that must import
    install: str = ""
    half_only: bool = False  # bf16/fp16 weights only


KERNELS = {
    "flash": Kernel("flash_attention_2", "flash_attn", "pip install flash-attn --no-build-isolation", half_only=True),
    "triton": Kernel("flex_attention", "triton", "a CUDA build of torch brings it"),
    "cutlass": Kernel(CUTLASS_SDPA),
}


def cutlass_sdpa_attention(
    module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any
) -> tuple[torch.Tensor, None]:
    """transformers' sdpa attention (same arguments) on torch's memory-efficient (CUTLASS) kernel only. That
    kernel takes no grouped key heads (sdpa's `enable_gqa`, which transformers asks for where no mask is passed:
    "No available kernel" on a GPU), so the key and value heads are repeated to the query's here, and transformers
    sees a module without groups."""
    groups = query.shape[1] // key.shape[1]
    ungrouped: Any = SimpleNamespace(
        is_causal=getattr(module, "is_causal", True), layer_idx=getattr(module, "layer_idx", 0)
    )
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        return sdpa_attention_forward(
            ungrouped, query, repeat_kv(key, groups), repeat_kv(value, groups), *args, **kwargs
        )


AttentionInterface.register(CUTLASS_SDPA, cutlass_sdpa_attention)
AttentionMaskInterface.register(CUTLASS_SDPA, sdpa_mask)


def attention_implementation(kernel: str, device: torch.device, dtype: torch.dtype) -> str | None:
    """The implementation the engine samples with (None: the model's own), or ConfigError naming the key
    when the kernel cannot run on `device` with `dtype` weights."""
    if kernel == "default":
        return None
    if device.type != "cuda":
        raise ConfigError(
            f"{KEY}={kernel} needs a CUDA GPU, but the engine samples on {device.type} "
            f"(backend.devices); on {device.type} keep {KEY}=default"
        )
    spec = KERNELS[kernel]
    if spec.package is not None and importlib.util.find_spec(spec.package) is None:
        raise ConfigError(f"{KEY}={kernel} needs the {spec.package} package, which is not installed ({spec.install})")
    if spec.half_only and dtype not in HALF_DTYPES:
        raise ConfigError(f"{KEY}={kernel} needs bf16 or fp16 weights, but the model is {dtype} (set model.dtype=bf16)")
    return spec.implementation


@contextmanager
def attending_with(model: Any, implementation: str | None) -> Iterator[None]:
    """`model` (PEFT-wrapped or not) attends with `implementation` inside the block, with its own after."""
    if implementation is None:
        yield
        return
    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    own = causal_lm.config._attn_implementation
    try:
        causal_lm.set_attn_implementation(implementation)
    except (ImportError, ValueError) as error:  # transformers' own refusal (a flash-attn build that fails)
        raise ConfigError(f"{KEY}: transformers cannot attend with {implementation!r} here: {error}") from error
    try:
        yield
    finally:
        causal_lm.set_attn_implementation(own)
