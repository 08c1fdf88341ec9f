"""retrain_cpu_sdpa (masked GQA inside the CPU kernel) and retrain_cuda_sdpa (no cuDNN attention) on the tiny model."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import retrain.model.attention as attention
from retrain.assets import TINY_MODEL_DIR
from retrain.model.attention import CPU_SDPA, CUDA_SDPA, use_fast_sdpa
from retrain.model.cache_argument import with_cache


def logits_and_gradients(model, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    logits = model(input_ids=ids, attention_mask=mask).logits
    logits.log_softmax(-1).square().mean().backward()
    gradients = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    return logits.detach(), gradients


def test_masked_gqa_attends_as_transformers_sdpa_does_and_through_the_kernel(monkeypatch):
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR)
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # grouped-query attention
    ids = torch.randint(0, 250, (3, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding: transformers passes a mask
    expected = logits_and_gradients(model, ids, mask)
    use_fast_sdpa(model)
    assert model.config._attn_implementation == CPU_SDPA
    grouped = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording(*args, **kwargs):
        grouped.append(kwargs.get("enable_gqa", False) and kwargs.get("attn_mask") is not None)
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", recording)
    logits, gradients = logits_and_gradients(model, ids, mask)
    assert grouped and all(grouped)  # every layer handed the grouping to the kernel
    assert torch.equal(logits, expected[0])
    assert len(gradients) == len(expected[1])
    for ours, theirs in zip(gradients, expected[1]):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)


def test_only_a_model_with_sdpa_is_switched():
    eager = AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR, attn_implementation="eager")
    use_fast_sdpa(eager)
    assert eager.config._attn_implementation == "eager"


def test_the_cuda_variant_attends_as_sdpa_does_with_cudnn_left_out_for_the_call(monkeypatch):
    """Its kernel choice is torch's global switch, set for the call and given back: checked here on CPU
    tensors (the switch exists without a GPU); tests/test_gpu.py runs it on one."""
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR)
    ids = torch.randint(0, 250, (3, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    expected = logits_and_gradients(model, ids, mask)
    model.set_attn_implementation(CUDA_SDPA)
    cudnn_during_calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording(*args, **kwargs):
        cudnn_during_calls.append(torch.backends.cuda.cudnn_sdp_enabled())
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    assert torch.backends.cuda.cudnn_sdp_enabled()
    logits, gradients = logits_and_gradients(model, ids, mask)
    assert cudnn_during_calls == [False] * model.config.num_hidden_layers
    assert torch.backends.cuda.cudnn_sdp_enabled()  # given back after each call
    assert torch.equal(logits, expected[0])
    assert all(torch.equal(ours, theirs) for ours, theirs in zip(gradients, expected[1], strict=True))


def decode_step_logits(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Logits of one cached decode step after a prefill of all but the last column (as the engine samples)."""
    with torch.inference_mode():
        prefill = model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], use_cache=True)
        step = model(
            input_ids=ids[:, -1:], attention_mask=mask, use_cache=True, **with_cache(model, prefill.past_key_values)
        )
    return step.logits[:, -1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decode_step_attends_with_each_group_s_heads_as_query_positions(monkeypatch, dtype):
    """One query per row: the heads sharing a key/value head go to the kernel as that head's positions,
    with no head repeated; bf16 gives sdpa's bits, fp32 its values up to rounding."""
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR, dtype=dtype)
    ids = torch.randint(0, 250, (4, 10), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[2, :3] = 0
    expected = decode_step_logits(model, ids, mask)
    use_fast_sdpa(model)
    query_shapes = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording(query, key, value, **kwargs):
        query_shapes.append((tuple(query.shape), tuple(key.shape), kwargs.get("enable_gqa", False)))
        return sdpa(query, key, value, **kwargs)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", recording)
    logits = decode_step_logits(model, ids, mask)
    config = model.config
    groups = config.num_attention_heads // config.num_key_value_heads
    folded = (
        (4, config.num_key_value_heads, groups, config.head_dim),
        (4, config.num_key_value_heads, 10, config.head_dim),
        False,
    )
    assert query_shapes[-config.num_hidden_layers :] == [folded] * config.num_hidden_layers
    if dtype == torch.bfloat16:
        assert torch.equal(logits, expected)
    else:
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
