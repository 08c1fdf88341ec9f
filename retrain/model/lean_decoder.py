"""A causal LM's logits without transformers' per-call machinery, for the sampler, the trainer and the probe.

Every forward retrain runs (a prefill, a decode step, the training forward, the freshness probe) goes
through `causal_lm_logits`. For the decoders whose wiring `LeanForward` mirrors (Llama, Mistral, Qwen2,
Qwen3; full attention, sdpa's masks) it calls the model's own leaf modules (embedding, the LoRA or plain
linears, the activation, the rotary embedding, lm_head) with transformers' tensor ops between them, in the
same order. What it leaves out is the machinery around them: the output-capturing and config-merging
decorators, the general mask factory (here the same boolean mask, built directly), the attention-interface
lookup, the decoder layer and attention module calls, and the [B, T, hidden] views around every matmul (the
hidden states stay [B·T, hidden] rows between attention blocks: the same products, fewer autograd nodes). A
small model's forward is mostly that machinery (docs/benchmarks.md, change 13).

It also launches fewer kernels than transformers' ops (on a GPU each op of an eager step is a launch:
benchmarks/decode_counts.py). Each RMSNorm is torch's `rms_norm` in every mode: one kernel where transformers'
module dispatches eight, and under autograd (training) one fused kernel each way on CUDA that saves its input in
the model's dtype, where transformers' ops save an fp32 copy and move ~12× the bytes (docs/benchmarks.md, the
training step's MFU ceiling). The trainer's norms are so also the sampler's. In every mode rotate_half's
negation and cat are one `roll` against a sin whose first half is negated once per forward: roll(x)·signed sin
multiplies the same numbers as rotate_half(x)·sin, the sign moved from one factor to the other, so that is
exact in any dtype. What that keeps (tests/inference/test_lean_decoder.py; tests/test_gpu.py on CUDA):

- fp32 on the CPU: to the bit under autograd (training; the LoRA linears compute as
  retrain/model/merged_lora.py routes them, in both) and without it through plain linears (no adapter, a merged
  or disabled one): the CPU's rms_norm computes transformers' fp32 arithmetic. A GPU's fused kernel may sum in
  another order: within fp32's rounding there.
- bf16/fp16: within the dtype's rounding. rms_norm rounds once (normalised times weight, in fp32) where
  transformers rounds the normalised value and then its product with the weight.

The unmerged LoRA linears without autograd are merged_lora.py's three ops in the compute dtype, where the o and
down projections' base matmuls also add the residual (`plus_linear`): within that dtype's rounding of
transformers' forward through PEFT's.

Under activation checkpointing (training) each layer runs through the checkpointing function transformers
gave it, so that backward recomputes the lean layer: the same ops, the same bits (the fused chains included).

Any other model, an attention implementation without sdpa's masks, or accelerate's device-map hooks take
transformers' own forward.

The trainer takes the decoder's last hidden states instead (`causal_lm_hidden`, the same forward less the
LM head): retrain/model/logprobs.py runs the head over chunks of tokens, so that a [tokens, vocabulary]
tensor of logits is never built whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import Cache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from retrain.model.attention import CPU_SDPA, CUDA_SDPA
from retrain.model.attention_kernels import CUTLASS_SDPA
from retrain.model.cache_argument import with_cache
from retrain.model.fused_elementwise import marked_fused, rotated, silu_times
from retrain.model.merged_lora import plus_linear

# model_type -> whether attention normalises each head's queries and keys (Qwen3's q_norm/k_norm)
MIRRORED = {"llama": False, "mistral": False, "qwen2": False, "qwen3": True}
SDPA_MASKED = {"sdpa", CPU_SDPA, CUDA_SDPA, CUTLASS_SDPA}  # attention that takes sdpa's boolean [B, 1, T, K] masks

# the model's own attribute holding _mirrored_head_norms' answer: looked at once per model object, and one
# attribute torch.compile guards on as a constant (a module-level weak dict it guards key by key, and a key
# collected between its trace and its guards failed the compile)
_HEAD_NORMS = "_retrain_head_norms"


def causal_lm_logits(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cache: Cache | None = None,
    logits_to_keep: int = 0,
    padded: bool | None = None,
) -> torch.Tensor:
    """[B, T or logits_to_keep, V] logits of `model` (a transformers causal LM, PEFT-wrapped or not), as
    `model(input_ids, attention_mask, position_ids, cache, use_cache, logits_to_keep).logits` gives them.
    A given `cache` is extended by this forward's keys and values; `attention_mask` covers cache and input.
    `padded`: whether `attention_mask` has a padding column, where the caller knows (None: the mask is looked at,
    which makes a GPU's host wait)."""
    lean = LeanForward.of(model)
    if lean is None:
        output = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=cache is not None,
            logits_to_keep=logits_to_keep,
            **({} if cache is None else with_cache(model, cache)),
        )
        return output.logits
    hidden = _lean_hidden(lean, input_ids, attention_mask, position_ids, cache, logits_to_keep, padded)
    return lean.causal_lm.lm_head(hidden)


def causal_lm_hidden(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cache: Cache | None = None,
    keep: int = 0,
) -> torch.Tensor:
    """[B, T or keep, hidden] last hidden states (after the final norm) of the decoder inside `model`: what its
    output embeddings turn into `causal_lm_logits`' logits. Arguments as causal_lm_logits takes them."""
    lean = LeanForward.of(model)
    if lean is not None:
        return _lean_hidden(lean, input_ids, attention_mask, position_ids, cache, keep)
    decoder = causal_lm_of(model).get_decoder()
    output = decoder(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=cache is not None,
        **({} if cache is None else with_cache(decoder, cache)),
    )
    return output.last_hidden_state[:, -keep:]


def _lean_hidden(
    lean: LeanForward,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    cache: Cache | None,
    keep: int,
    padded: bool | None = None,
) -> torch.Tensor:
    """`lean.hidden` with the mask and positions transformers' forward derives from its arguments."""
    past = cache.get_seq_length() if cache is not None else 0
    attend = cache_attention(cache)
    mask = None
    if attend is None:  # a cache's own attention knows which keys each query sees
        mask = sdpa_mask(attention_mask, input_ids.shape[0], input_ids.shape[1], past, input_ids.device, padded)
    if position_ids is None:
        position_ids = (torch.arange(input_ids.shape[1], device=input_ids.device) + past).unsqueeze(0)
    return lean.hidden(input_ids, mask, position_ids, cache, keep, attend)


def cache_attention(cache: Cache | None) -> Any | None:
    """The attention function (transformers' interface) a cache brings for this forward, if any: the paged KV
    pool's, which reads keys and values through block tables (retrain/inference/sampler/paged_cache.py)."""
    own = getattr(cache, "attention", None)
    return own() if callable(own) else None


def sdpa_mask(
    attention_mask: torch.Tensor | None,
    batch: int,
    length: int,
    past: int,
    device: torch.device,
    padded: bool | None = None,
) -> torch.Tensor | None:
    """The [B, 1, T, past + T] boolean mask transformers' sdpa_mask builds for a dynamic cache (a key is
    seen if it is not padding and not after the query), or None where it leaves causality to sdpa's
    `is_causal`: a single query or no cache, and no padding (`padded`, where the caller knows; else looked at)."""
    total = past + length
    if attention_mask is not None and attention_mask.shape[-1] != total:
        raise ValueError(f"attention_mask covers {attention_mask.shape[-1]} positions, cache and input {total}")
    padding = None if attention_mask is None else attention_mask.bool()
    if (length == 1 or past == 0) and not _has_padding(padding, padded):
        return None
    causal = torch.arange(total, device=device) <= torch.arange(past, total, device=device).unsqueeze(-1)
    mask = causal[None, None] if padding is None else causal[None, None] & padding[:, None, None, :]
    return mask.expand(batch, 1, length, total)


def _has_padding(padding: torch.Tensor | None, known: bool | None) -> bool:
    if padding is None:
        return False
    return known if known is not None else not bool(padding.all())


@dataclass(frozen=True)
class LeanForward:
    """transformers' forward of a mirrored decoder, wiring only; see the module docstring."""

    causal_lm: Any  # the transformers *ForCausalLM inside any PEFT wrappers
    head_norms: bool  # Qwen3: each head's queries and keys are RMS-normalised before the rotation
    fused: bool = False  # the training forward's rotary embedding is one kernel each way (fused_elementwise.py)
    fused_mlp: bool = False  # and so is SiLU·up (a SiLU MLP)
    checkpointed: bool = False  # each layer recomputed in backward (activation checkpointing while training)

    @classmethod
    def of(cls, model: Any) -> LeanForward | None:
        """The model's lean forward, or None where transformers' own forward must run now."""
        causal_lm = causal_lm_of(model)
        if not hasattr(causal_lm, _HEAD_NORMS):
            setattr(causal_lm, _HEAD_NORMS, _mirrored_head_norms(causal_lm))
        head_norms: bool | None = getattr(causal_lm, _HEAD_NORMS)
        if head_norms is None or causal_lm.config._attn_implementation not in SDPA_MASKED:
            return None
        fused = marked_fused(causal_lm)
        silu = causal_lm.config.hidden_act == "silu"
        return cls(causal_lm, head_norms, fused, fused and silu, _checkpointing(causal_lm) and torch.is_grad_enabled())

    def hidden(
        self,
        input_ids: torch.Tensor,
        mask: torch.Tensor | None,
        position_ids: torch.Tensor,
        cache: Cache | None,
        keep: int,
        attend: Any | None = None,
    ) -> torch.Tensor:
        """[B, T or keep, hidden] the final norm's output, which transformers hands to the LM head; `mask`: which keys
        (cache, then input) each query sees, [B, 1, T, K] booleans, or None for plain causal attention (sdpa's
        `is_causal`; a single query sees every key). `attend`: the attention function, where not the model's own
        (`cache_attention`). Checkpointed, no cache: a recomputed layer would write its keys and values again."""
        if self.checkpointed and cache is not None:
            raise ValueError(
                "a KV cache cannot be filled by layers that recompute in backward (activation checkpointing)"
            )
        decoder, config = self.causal_lm.model, self.causal_lm.config
        batch, length = input_ids.shape
        hidden = decoder.embed_tokens(input_ids)
        cos, sin = decoder.rotary_emb(hidden, position_ids)
        rotation = (cos.unsqueeze(2), _signed_sin(sin).unsqueeze(2))  # [B, T, 1, head_dim]: each head alike
        attend = attend or ALL_ATTENTION_FUNCTIONS[config._attn_implementation]
        hidden = hidden.view(batch * length, -1)
        for layer in decoder.layers[: config.num_hidden_layers]:
            arguments = (layer, hidden, (batch, length), rotation, mask, cache, attend)
            hidden = (
                layer._gradient_checkpointing_func(self._layer, *arguments)
                if self.checkpointed
                else self._layer(*arguments)
            )
        hidden = _rms_norm(decoder.norm, hidden).view(batch, length, -1)
        return hidden[:, slice(-keep, None), :]

    def _layer(
        self,
        layer: Any,
        hidden: torch.Tensor,
        input_shape: tuple[int, int],
        rotation: tuple[torch.Tensor, torch.Tensor],
        mask: Any,
        cache: Cache | None,
        attend: Any,
    ) -> torch.Tensor:
        """One decoder layer on the [B·T, hidden] rows: attention, then the MLP, each added to its input."""
        normed = _rms_norm(layer.input_layernorm, hidden)
        hidden = self._attention(layer.self_attn, normed, hidden, input_shape, rotation, mask, cache, attend)
        return self._mlp(layer.mlp, _rms_norm(layer.post_attention_layernorm, hidden), hidden)

    def _attention(
        self,
        module: Any,
        hidden: torch.Tensor,
        residual: torch.Tensor,
        input_shape: tuple[int, int],
        rotation: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | None,
        cache: Cache | None,
        attend: Any,
    ) -> torch.Tensor:
        """`residual` plus transformers' Llama/Qwen3 attention forward on the [B·T, hidden] rows of a [B, T] input."""
        hidden_shape = (*input_shape, -1, module.head_dim)
        queries = module.q_proj(hidden).view(hidden_shape)
        keys = module.k_proj(hidden).view(hidden_shape)
        if self.head_norms:
            queries, keys = _rms_norm(module.q_norm, queries), _rms_norm(module.k_norm, keys)
        values = module.v_proj(hidden).view(hidden_shape).transpose(1, 2)
        queries = rotated(queries, rotation, self.fused).transpose(1, 2)
        keys = rotated(keys, rotation, self.fused).transpose(1, 2)
        if cache is not None:
            keys, values = cache.update(keys, values, module.layer_idx)
        dropout = 0.0 if not module.training else module.attention_dropout
        output, _ = attend(module, queries, keys, values, mask, dropout=dropout, scaling=module.scaling)
        return plus_linear(module.o_proj, output.reshape(hidden.shape[0], -1).contiguous(), residual)

    def _mlp(self, module: Any, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """`residual` plus the MLP's output, the add in the down projection where that can take it (`plus_linear`)."""
        if self.fused_mlp:
            activated = silu_times(module.gate_proj(hidden), module.up_proj(hidden), fused=True)
        else:
            activated = module.act_fn(module.gate_proj(hidden)) * module.up_proj(hidden)
        return plus_linear(module.down_proj, activated, residual)


def keeps_caches(model: Any) -> bool:
    """Whether a forward of `model` now may fill a KV cache: not where its layers recompute in backward (the lean
    forward's, under autograd) or transformers' checkpointed layers drop caches (in training mode, grad or not)."""
    lean = LeanForward.of(model)
    return not lean.checkpointed if lean is not None else not _checkpointing(causal_lm_of(model))


def causal_lm_of(model: Any) -> Any:
    """The transformers *ForCausalLM inside any PEFT wrappers."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def mirrored(model: Any) -> bool:
    """Whether the lean forward mirrors `model`'s architecture (it runs where it also may now: `LeanForward.of`)."""
    return _mirrored_head_norms(causal_lm_of(model)) is not None


def _mirrored_head_norms(causal_lm: Any) -> bool | None:
    """Whether a mirrored decoder normalises attention heads; None for a model whose forward is not mirrored."""
    config = causal_lm.config
    if config.model_type not in MIRRORED or not hasattr(causal_lm, "lm_head"):
        return None
    if getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True):
        return None  # a sliding-window mask (Mistral's; Qwen2/3 name theirs in layer_types)
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or []):
        return None
    if any(hasattr(module, "_hf_hook") for module in causal_lm.modules()):
        return None  # accelerate's device-map hooks move tensors between devices inside transformers' forward
    return MIRRORED[config.model_type]


def _checkpointing(causal_lm: Any) -> bool:
    """A decoder layer would recompute its activations in backward (transformers' GradientCheckpointingLayer
    does while training; the model's is_gradient_checkpointing walks every module, ~1 ms a call)."""
    return causal_lm.training and any(
        getattr(layer, "gradient_checkpointing", False) and layer.training for layer in causal_lm.model.layers
    )


def _rms_norm(module: Any, hidden: torch.Tensor) -> torch.Tensor:
    """The RMSNorm module's output by torch's rms_norm: normalised in fp32, times the weight, rounded once."""
    return F.rms_norm(hidden, (hidden.shape[-1],), module.weight, module.variance_epsilon)


def _signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin with its first half negated: rotate_half(x)·sin = roll(x, half)·signed sin, the sign moved out of the
    layers into one op per forward."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
