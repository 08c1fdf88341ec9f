"""The training forward's rotary embedding and SiLU·up fused (retrain/model/fused_elementwise.py): compiled on the
CPU here as a GPU compiles them, the eager bits in bf16, one kernel each way when counted, and what the trainer
and the memory plan decide."""

from __future__ import annotations

import pytest
import torch
from torch.utils._triton import has_triton

from retrain.errors import ConfigError
from retrain.model.counting import count_ops
from retrain.model.fused_elementwise import fuses_elementwise, mark_fused, marked_fused, rotated, silu_times
from retrain.model.lean_decoder import causal_lm_logits, causal_lm_of
from retrain.model.merged_lora import lean_lora, plain_lora_layers
from retrain.model.rows import positions_from_mask
from tests.backend.tiny_model import make_backend
from tests.inference.test_lean_decoder import (
    CONFIGS,
    SIZES,
    bf16_with_fp32_adapters,
    checkpointed_step,
    left_padded_batch,
    lora_model,
    training_step,
)

LAYERS = SIZES["num_hidden_layers"]
ON_GPU_TOO = [
    "cpu",
    pytest.param("cuda", id="gpu", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")),
]


def chains(length: int, dtype: torch.dtype, fused: bool, device: str = "cpu") -> list[torch.Tensor]:
    """Both chains' outputs and their inputs' gradients, on random [2, length] inputs (the same for each `fused`)."""
    generator = torch.Generator().manual_seed(length)

    def random(*shape: int, grad: bool = False) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(device, dtype).requires_grad_(grad)

    x, cos, sin = random(2, length, 4, 16, grad=True), random(2, length, 1, 16), random(2, length, 1, 16)
    gate, up = random(2 * length, 24, grad=True), random(2 * length, 24, grad=True)
    turned, activated = rotated(x, (cos, sin), fused), silu_times(gate, up, fused)
    (dx,) = torch.autograd.grad(turned, x, random(*turned.shape))
    dgate, dup = torch.autograd.grad(activated, (gate, up), random(*activated.shape))
    return [turned.detach(), activated.detach(), dx, dgate, dup]


@pytest.mark.parametrize("device", ON_GPU_TOO)
def test_compiled_the_chains_give_the_eager_bits_in_bf16_at_every_length_from_one_compile(device: str) -> None:
    for at, length in enumerate((37, 53)):
        with torch._dynamo.config.patch(error_on_recompile=at > 0):  # one compile serves every length
            fused = chains(length, torch.bfloat16, True, device)
        eager = chains(length, torch.bfloat16, False, device)
        assert all(torch.equal(a, b) for a, b in zip(fused, eager, strict=True))


def test_compiled_in_fp32_the_chains_are_the_eager_ones_within_rounding() -> None:
    """SiLU's backward is computed in another order there: a last bit may differ."""
    for fused, eager in zip(chains(29, torch.float32, True), chains(29, torch.float32, False), strict=True):
        torch.testing.assert_close(fused, eager, rtol=1e-6, atol=1e-6)


def qwen3_in_bf16(fused: bool, device: str = "cpu") -> torch.nn.Module:
    model = bf16_with_fp32_adapters(lora_model(CONFIGS["qwen3"]())).to(device).train()
    mark_fused(causal_lm_of(model), fused)
    return model


@pytest.mark.parametrize("device", ON_GPU_TOO)
def test_a_fused_bf16_training_forward_gives_the_eager_logits_and_lora_gradients_to_the_bit(device: str) -> None:
    steps = (training_step(qwen3_in_bf16(fused, device)) for fused in (True, False))
    (fused_logits, fused_grads), (logits, grads) = steps
    assert torch.equal(fused_logits, logits)
    assert all(torch.equal(a, b) for a, b in zip(fused_grads, grads, strict=True))


def test_checkpointed_the_fused_chains_recompute_to_the_bit() -> None:
    """Activation checkpointing recomputes each layer in backward, its compiled chains included: the same bits."""
    model = qwen3_in_bf16(fused=True)
    (logits, grads, calls), (plain_logits, plain_grads, _) = (checkpointed_step(model, on) for on in (True, False))
    assert calls == 2  # the layer did recompute
    assert torch.equal(logits, plain_logits)
    assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads, strict=True))


def counted_step(fused: bool, grad: bool = True):
    model = qwen3_in_bf16(fused)
    ids, mask = left_padded_batch()
    with count_ops() as counts, torch.set_grad_enabled(grad), lean_lora(plain_lora_layers(model)):
        logits = causal_lm_logits(model, ids, mask, positions_from_mask(mask.bool()))
        if grad:
            logits.float().sum().backward()
    return counts


def test_counted_each_fused_chain_is_one_kernel_each_way_moving_fewer_bytes() -> None:
    """Counted, the chains run eagerly (nothing compiles under the counter) and count as a GPU's kernels."""
    fused, eager = counted_step(True), counted_step(False)
    compute = fused.compute
    assert compute["rotary"] == compute["rotary_backward"] == 2 * LAYERS  # queries and keys
    assert compute["silu_times"] == compute["silu_times_backward"] == LAYERS
    assert "roll" not in compute and "silu" not in compute and "silu_backward" not in compute
    assert eager.compute["roll"] >= 4 * LAYERS  # a roll each way, queries and keys
    assert fused.compute_ops < eager.compute_ops
    assert fused.plain_bytes < eager.plain_bytes
    assert fused.flops == eager.flops


def test_without_autograd_a_fused_model_runs_the_eager_ops() -> None:
    """Sampling, the probe and the KL reference are not fused: a decode step's CUDA graph records eager ops."""
    assert counted_step(True, grad=False).compute == counted_step(False, grad=False).compute


@pytest.mark.parametrize(
    ("setting", "device", "fuses"),
    [
        ("auto", "cpu", False),  # the CPU's compile costs each first step tens of seconds
        ("false", "cuda", False),
        ("true", "cpu", True),
        ("auto", "cuda", has_triton()),
    ],
)
def test_the_setting_resolves_by_device(setting: str, device: str, fuses: bool) -> None:
    assert fuses_elementwise(setting, torch.device(device)) is fuses


@pytest.mark.skipif(has_triton(), reason="triton is installed here")
def test_true_on_a_gpu_without_triton_is_refused_naming_the_key() -> None:
    with pytest.raises(ConfigError, match=r"backend.fused_elementwise=true needs triton"):
        fuses_elementwise("true", torch.device("cuda"))


def test_the_backend_marks_its_model(tiny_spec) -> None:
    for setting, fused in (("true", True), ("false", False), ("auto", False)):
        backend = make_backend(tiny_spec, fused_elementwise=setting)
        assert marked_fused(causal_lm_of(backend.model)) is fused
