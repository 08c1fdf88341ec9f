"""An eager decode step's kernel count: what a GPU launches per step, counted on the CPU through
`generate()` on the bundled tiny Qwen3 in bf16 with its LoRA unmerged, the GPU's sampling path."""

from __future__ import annotations

import torch

from retrain.model.counting import count_decode
from retrain.model.spec import ModelSpec
from retrain.types import SamplingParams
from tests.backend.tiny_model import PROMPTS, encode, make_backend, make_engine

MAX_OPS_PER_STEP_PER_LAYER = 60  # 116.8 before the norms were fused, the LoRA scale folded and its casts cached
LORA_LINEARS_PER_LAYER = 7  # q, k, v, o, gate, up, down


def test_a_bf16_decode_step_with_unmerged_lora_dispatches_at_most_60_ops_per_layer() -> None:
    backend = make_backend(ModelSpec(name_or_path="retrain:tiny_qwen3", lora_rank=4, dtype="bf16"))
    engine = make_engine(backend, merge_lora=False)
    assert engine._merged is None and engine._lean  # every LoRA linear unmerged
    prompt_ids = encode(backend, PROMPTS[:2])
    engine.generate(prompt_ids, 2, SamplingParams(max_tokens=2, temperature=1.0), 0)  # A and s·B cast once
    with count_decode(engine.model) as decode:
        engine.generate(prompt_ids, 2, SamplingParams(max_tokens=8, temperature=1.0), 1)
    layers = engine.model.config.num_hidden_layers
    assert decode.steps > 0
    step = decode.step
    assert step.compute_ops / decode.steps / layers <= MAX_OPS_PER_STEP_PER_LAYER, step.compute.most_common()
    # each LoRA linear is base, x·A and one addmm adding (x·A)·(s·B): no cast, scale or add of its own; the o and
    # down projections' base matmuls are addmms too, adding the residual
    assert step.compute["addmm"] == (LORA_LINEARS_PER_LAYER + 2) * layers * decode.steps
    assert step.compute["rms_norm"] == (4 * layers + 1) * decode.steps  # input, post-attention, q, k; final
    assert step.compute["pow"] == 0  # no norm decomposed
    assert step.compute["neg"] == decode.steps  # rotate_half's sign: once per forward, in the signed sin


def test_cached_adapter_casts_follow_an_update() -> None:
    """A and s·B are cast once per weight version: an optimizer-like in-place update shows in the next step."""
    backend = make_backend(ModelSpec(name_or_path="retrain:tiny_qwen3", lora_rank=4, dtype="bf16"))
    engine = make_engine(backend, merge_lora=False)
    prompt_ids = encode(backend, PROMPTS[:1])
    sampling = SamplingParams(max_tokens=4, temperature=1.0)
    before = engine.generate(prompt_ids, 2, sampling, 0)
    with torch.no_grad():
        for name, parameter in backend.model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.5)  # B was 0: the adapter now moves the logits
    after = engine.generate(prompt_ids, 2, sampling, 0)
    assert not torch.equal(before.logprobs, after.logprobs)
