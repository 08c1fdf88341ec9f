"""transformers' sdpa attention with the kernel choices that suit RL's shapes, per device.

CPU, "retrain_cpu_sdpa": transformers' "sdpa" attention repeats every key/value head for its query
heads (`repeat_kv`: a copy forward, a sum backward) whenever a mask is passed, because CUDA's fused
kernels take grouped-query attention only without one. torch's CPU kernels take masked GQA directly
(`enable_gqa`): the outputs are the same and an attention call costs ~20-35% less at the tiny
model's shapes (~3% of its step). A decode step's single query goes further: the query heads that
share a key/value head become that head's query positions (one row per head of the group), which
the flash kernel serves with the same arithmetic per row; in bf16 it costs ~3.5x less and gives the
same bits (the kernel's bf16 path is slow on one query per head: small64's bf16 sampling spent 30%
of its time there), in fp32 ~10% less and the same values up to rounding.

CUDA, "retrain_cuda_sdpa": sdpa without cuDNN's attention kernel. cuDNN builds an execution plan
for every new input shape, and an RL step's shapes change on nearly every call (prompt and
completion lengths, rows leaving the decode batch as they finish), so on an H100 (torch 2.11) it
cost ~9 ms of host time per call: small64's sampling took 4.8 s a step with it, 1.2 s without.
Flash and memory-efficient attention plan nothing per shape.

Both registered with transformers, with sdpa's masks; `use_fast_sdpa` switches a model to its device's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

CPU_SDPA = "retrain_cpu_sdpa"
CUDA_SDPA = "retrain_cuda_sdpa"
WITHOUT_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def cpu_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' sdpa attention, but a masked GQA call hands the grouping to the kernel, and a single
    query attends with its group's heads folded into query positions."""
    grouped = query.shape[1] != key.shape[1]
    extras = (
        kwargs.get("output_attentions") or kwargs.get("position_bias") is not None or kwargs.get("cache") is not None
    )
    if grouped and not extras and _single_query_per_row(query, attention_mask, dropout):
        return _folded_single_query(query, key, value, attention_mask, scaling), None
    if attention_mask is None or not grouped or extras:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    output = F.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
    )
    return output.transpose(1, 2).contiguous(), None


def _single_query_per_row(query: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float) -> bool:
    """A decode step: one query position, a mask (if any) shared by all heads, no dropout."""
    shared_mask = attention_mask is None or (attention_mask.shape[1] == 1 and attention_mask.shape[2] == 1)
    return query.shape[2] == 1 and shared_mask and dropout == 0.0


def _folded_single_query(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None,
) -> torch.Tensor:
    """Attention of [B, H, 1, D] queries over [B, KV, L, D] keys/values as [B, KV, H/KV, D] queries: the
    heads of a group are independent rows against the same keys, and the mask ([B, 1, 1, L]) is the same
    for each. Returned as transformers lays attention out: [B, 1, H, D]."""
    batch, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    grouped_query = query.reshape(batch, kv_heads, heads // kv_heads, dim)
    output = F.scaled_dot_product_attention(grouped_query, key, value, attn_mask=attention_mask, scale=scaling)
    return output.reshape(batch, 1, heads, dim)


def cuda_sdpa_attention(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' sdpa attention (same arguments), choosing among flash, memory-efficient and math kernels only."""
    with sdpa_kernel(WITHOUT_CUDNN):
        return sdpa_attention_forward(*args, **kwargs)


for _name, _attention in [(CPU_SDPA, cpu_sdpa_attention), (CUDA_SDPA, cuda_sdpa_attention)]:
    AttentionInterface.register(_name, _attention)
    AttentionMaskInterface.register(_name, sdpa_mask)

FAST_SDPA = {"cpu": CPU_SDPA, "cuda": CUDA_SDPA}


def use_fast_sdpa(model: Any) -> None:
    """A model on CPU or CUDA that attends with sdpa attends with its device's variant from now on."""
    implementation = FAST_SDPA.get(model.device.type)
    if implementation is not None and model.config._attn_implementation == "sdpa":
        model.set_attn_implementation(implementation)
