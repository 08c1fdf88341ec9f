"""retrain_cpu_sdpa: transformers' sdpa attention with masked GQA inside the CPU kernel, on the tiny model."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

import retrain.backend.attention as attention
from retrain.assets import TINY_MODEL_DIR
from retrain.backend.attention import CPU_SDPA, use_cpu_sdpa


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
    use_cpu_sdpa(model)
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


def test_only_a_cpu_model_with_sdpa_is_switched():
    eager = AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR, attn_implementation="eager")
    use_cpu_sdpa(eager)
    assert eager.config._attn_implementation == "eager"
