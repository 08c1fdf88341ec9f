"""Sampling through merged LoRA weights and training through the lean LoRA forward
(retrain/model/merged_lora.py), on the real tiny model."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
from peft.tuners.lora.layer import Linear as LoraLinear

from retrain.model.merged_lora import lean_lora, merged_lora, plain_lora_layers
from retrain.types import SamplingParams, TrainBatch
from tests.backend.tiny_model import PROMPTS, encode, make_backend, make_engine

SAMPLING = SamplingParams(max_tokens=6, temperature=1.0, top_p=1.0)


def sample_both(backend, prompt_ids, seed: int):
    merged = make_engine(backend).generate(prompt_ids, 4, SAMPLING, generator_seed=seed)
    plain = make_engine(backend, merge_lora=False).generate(prompt_ids, 4, SAMPLING, generator_seed=seed)
    return merged, plain


def a_training_step(backend, rollouts) -> None:
    advantages = torch.linspace(-1, 1, rollouts.completion_ids.shape[0]).unsqueeze(1) * rollouts.completion_mask
    batch = TrainBatch(rollouts=rollouts, advantages=advantages, row_mask=torch.ones(len(advantages), dtype=torch.bool))
    assert backend.train(batch).update is not None


def test_merged_and_plain_layers_sample_the_same_policy_before_and_after_updates(tiny_spec):
    backend = make_backend(tiny_spec, lr=5e-2)
    prompt_ids = encode(backend, PROMPTS)
    for step in range(3):  # step 0: B = 0, so W + s·B·A = W; then two real updates move the adapter
        merged, plain = sample_both(backend, prompt_ids, seed=step)
        assert torch.equal(merged.completion_ids, plain.completion_ids), step
        # fp32 rounding between the two paths grows with |log-prob|
        torch.testing.assert_close(merged.logprobs, plain.logprobs, atol=1e-5, rtol=1e-5)
        a_training_step(backend, plain)
    assert any(float(p.detach().abs().max()) > 0 for name, p in backend.adapter.items() if "lora_B" in name)


def test_the_merged_weight_follows_every_change_of_the_adapter(tiny_spec):
    backend = make_backend(tiny_spec)
    merged = merged_lora(plain_lora_layers(backend.model))
    assert merged is not None and len(merged.layers) == 4 * len(tiny_spec.target_modules)
    layer = merged.layers[0]
    first = merged._weight(layer)
    assert merged._weight(layer) is first  # no rebuild while nothing changed
    with torch.no_grad():
        layer.lora_B["default"].weight.add_(0.5)
    rebuilt = merged._weight(layer)
    expected = (
        layer.base_layer.weight
        + layer.scaling["default"] * layer.lora_B["default"].weight @ layer.lora_A["default"].weight
    )
    torch.testing.assert_close(rebuilt, expected)
    assert not torch.equal(rebuilt, first)


def test_serving_routes_the_layers_only_inside_the_block(tiny_spec):
    backend = make_backend(tiny_spec)
    merged = merged_lora(plain_lora_layers(backend.model))
    assert merged is not None
    with merged.serving():
        assert all("forward" in layer.__dict__ for layer in merged.layers)
    assert not any("forward" in layer.__dict__ for layer in merged.layers)  # training uses PEFT's own forward


def test_half_precision_layers_are_never_merged_and_sample_as_peft_does(tiny_spec):
    """Rounding W + s·B·A to bf16 would drop most of a small update: such layers sample unmerged, through
    the lean forward's bf16 LoRA (A and s·B cast once), which gives PEFT's tokens and its log-probs within
    bf16's rounding."""
    backend = make_backend(dataclasses.replace(tiny_spec, dtype="bf16"), lr=5e-2)
    assert backend.model.dtype == torch.bfloat16
    layers = plain_lora_layers(backend.model)
    assert merged_lora(layers) is None
    engine = make_engine(backend)
    assert engine._merged is None and engine._lean == layers
    prompt_ids = encode(backend, PROMPTS)
    a_training_step(backend, engine.generate(prompt_ids, 4, SAMPLING, generator_seed=0))  # B != 0 from here
    lean = engine.generate(prompt_ids, 4, SAMPLING, generator_seed=1)
    engine._lean = []  # every layer through PEFT's own forward
    peft = engine.generate(prompt_ids, 4, SAMPLING, generator_seed=1)
    assert torch.equal(lean.completion_ids, peft.completion_ids)
    # bf16 logits, the top ones in [8, 16) where an ulp is 2^-4, the LoRA term and residual rounded apart: seen 0.031
    torch.testing.assert_close(lean.logprobs, peft.logprobs, atol=2**-4, rtol=0)


def test_layers_whose_adapter_is_disabled_keep_peft_s_own_forward(tiny_spec):
    """Inside PEFT's disable_adapter() the model is the base model: the merged weight must not serve it."""
    backend = make_backend(tiny_spec)
    merged = merged_lora(plain_lora_layers(backend.model))
    assert merged is not None
    layer = merged.layers[0]
    with torch.no_grad():
        layer.lora_B["default"].weight.add_(0.5)  # the adapter now changes this layer's output
    x = torch.randn(3, layer.base_layer.in_features)
    with backend.model.disable_adapter(), merged.serving(), torch.no_grad():
        assert not any("forward" in routed.__dict__ for routed in merged.layers)
        torch.testing.assert_close(layer(x), layer.base_layer(x), atol=0, rtol=0)
    with merged.serving(), torch.no_grad():
        torch.testing.assert_close(layer(x), x @ merged._weight(layer).T)


@pytest.mark.parametrize(("dtype", "tolerance"), [("fp32", 1e-6), ("bf16", 2**-6)])
def test_without_autograd_a_lean_lora_linear_is_peft_s_within_rounding(tiny_spec, dtype, tolerance):
    """base + (x·A)·(s·B) in the compute dtype, A and s·B cast once per weight version: PEFT's output within that
    dtype's rounding, relative to the output's largest entry (bf16: two ulps; seen one), before and after the
    adapter moves."""
    backend = make_backend(dataclasses.replace(tiny_spec, dtype=dtype))
    layers = plain_lora_layers(backend.model)
    torch.manual_seed(0)
    x = torch.randn(5, layers[0].base_layer.in_features).to(backend.model.dtype)
    for _ in range(2):
        with torch.no_grad():
            for p in backend.adapter.values():
                p.add_(0.05 * torch.randn_like(p))  # an optimizer step: the cached casts must follow
            peft = LoraLinear.forward(layers[0], x).float()
            with lean_lora(layers):
                lean = layers[0](x).float()
        assert (lean - peft).abs().max() <= tolerance * peft.abs().max()


def loss_and_gradients(backend, ids: torch.Tensor, lean: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One train-mode forward and backward (dropout drawn from a fixed seed), through PEFT or the lean path."""
    model = backend.model
    model.train()
    torch.manual_seed(0)
    with lean_lora(plain_lora_layers(model)) if lean else contextlib.nullcontext():
        loss = model(input_ids=ids).logits.log_softmax(-1).square().mean()
    loss.backward()
    gradients = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), gradients


def adapted(tiny_spec, dtype: str):
    backend = make_backend(dataclasses.replace(tiny_spec, lora_dropout=0.1, dtype=dtype))
    assert all(p.dtype == torch.float32 for p in backend.adapter.values())  # fp32 master weights in any dtype
    with torch.no_grad():  # a nonzero B, so every LoRA matmul carries gradient
        for p in backend.adapter.values():
            p.add_(0.05 * torch.randn_like(p))
    return backend


def test_lean_lora_gives_peft_s_losses_and_gradients_bit_for_bit_in_fp32(tiny_spec):
    backend = adapted(tiny_spec, "fp32")
    ids = torch.tensor(encode(backend, PROMPTS[:1]) * 3)
    lean_loss, lean_gradients = loss_and_gradients(backend, ids, lean=True)
    peft_loss, peft_gradients = loss_and_gradients(backend, ids, lean=False)
    assert torch.equal(lean_loss, peft_loss)
    assert lean_gradients.keys() == peft_gradients.keys() and len(lean_gradients) == len(backend.adapter)
    assert all(torch.equal(lean_gradients[name], peft_gradients[name]) for name in peft_gradients)
    layers = plain_lora_layers(backend.model)
    with lean_lora(layers):
        assert all("forward" in vars(layer) for layer in layers)
    assert not any("forward" in vars(layer) for layer in layers)


def test_in_bf16_the_lora_branch_trains_in_bf16_with_fp32_master_weights(tiny_spec):
    """PEFT casts each adapted linear's input to fp32 and sums in fp32; the lean forward keeps the branch in bf16
    (A and s·B cast in the graph): PEFT's loss and fp32 gradients within bf16's rounding, and autograd keeps no fp32
    copy of any linear's input."""
    backend = adapted(tiny_spec, "bf16")
    ids = torch.tensor(encode(backend, PROMPTS[:1]) * 3)
    lean_loss, lean_gradients = loss_and_gradients(backend, ids, lean=True)
    peft_loss, peft_gradients = loss_and_gradients(backend, ids, lean=False)
    torch.testing.assert_close(lean_loss, peft_loss, rtol=2e-2, atol=0)
    assert lean_gradients.keys() == peft_gradients.keys() and len(lean_gradients) == len(backend.adapter)
    lean, peft = (torch.cat([g[name].flatten() for name in sorted(g)]) for g in (lean_gradients, peft_gradients))
    assert lean.dtype == torch.float32
    assert (lean - peft).norm() <= 0.05 * peft.norm()  # seen ~1%: bf16's 2^-8 per product, summed over tokens
    mlp_width = backend.model.config.intermediate_size  # down_proj's input: PEFT saves an fp32 copy of it
    assert mlp_width in fp32_saved_widths(backend, ids, lean=False)
    assert mlp_width not in fp32_saved_widths(backend, ids, lean=True)


def fp32_saved_widths(backend, ids: torch.Tensor, lean: bool) -> set[int]:
    """The last dimensions of the fp32 tensors autograd saves for backward with [tokens, features] rows."""
    widths = set()

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dtype == torch.float32 and not tensor.requires_grad and tensor.dim() >= 2:
            widths.add(tensor.shape[-1])
        return tensor

    with (
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        lean_lora(plain_lora_layers(backend.model)) if lean else contextlib.nullcontext(),
    ):
        backend.model(input_ids=ids).logits.sum()
    return widths
