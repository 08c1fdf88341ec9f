"""The lean forward is transformers' forward, for every decoder it mirrors (to the bit in fp32 on the CPU, within
rounding in bf16: retrain/model/lean_decoder.py), and steps aside for the rest; in bf16 training and sampling
compute the same norms."""

from __future__ import annotations

import contextlib
import functools
import gc

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import (
    AutoModelForCausalLM,
    DynamicCache,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)
from transformers.masking_utils import sdpa_mask as transformers_sdpa_mask

from retrain.backend.local import enable_activation_checkpointing
from retrain.model.attention import use_fast_sdpa
from retrain.model.cache_argument import with_cache
from retrain.model.counting import count_ops
from retrain.model.lean_decoder import LeanForward, causal_lm_logits, sdpa_mask
from retrain.model.merged_lora import lean_lora, plain_lora_layers
from retrain.model.rows import positions_from_mask

SIZES = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 97,
    "max_position_embeddings": 64,
}
CONFIGS = {
    "llama": lambda: LlamaConfig(**SIZES),
    "mistral": lambda: MistralConfig(**SIZES, sliding_window=None),
    "qwen2": lambda: Qwen2Config(**SIZES),
    "qwen3": lambda: Qwen3Config(**SIZES, head_dim=16),
}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_model(config, attention: str = "fast") -> torch.nn.Module:
    """A random model of `config` under a LoRA adapter whose B is not zero (so the adapter takes part), its norms'
    weights not ones (so a product with them rounds)."""
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config, attn_implementation="eager" if attention == "eager" else "sdpa")
    if attention == "fast":
        use_fast_sdpa(base)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.05)
            elif "norm" in name:
                parameter.normal_(mean=1.0, std=0.2)
    return model


def transformers_logits(model, input_ids, attention_mask=None, position_ids=None, cache=None, logits_to_keep=0):
    cache_argument = {} if cache is None else with_cache(model, cache)
    output = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=cache is not None,
        logits_to_keep=logits_to_keep,
        **cache_argument,
    )
    return output.logits


def left_padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 97, (3, 9), generator=generator)
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[0, :4] = 0
    mask[2, :1] = 0
    return ids, mask


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
@pytest.mark.parametrize("attention", ["fast", "sdpa"])
@pytest.mark.parametrize("adapter", ["disabled", "unmerged"])
def test_prefill_and_decode_steps_give_transformers_logits(model_type, attention, adapter):
    """To the bit in fp32 with the linears plain (here the adapter disabled; merged is the same: a plain matmul);
    through unmerged LoRA linears within fp32's rounding, where the lean forward adds the residual in the o and
    down projections' base matmuls (merged_lora.plus_linear) and transformers after them."""
    model = lora_model(CONFIGS[model_type](), attention).eval()
    assert LeanForward.of(model) is not None
    ids, mask = left_padded_batch()
    disabled = model.disable_adapter() if adapter == "disabled" else contextlib.nullcontext()
    with torch.inference_mode(), disabled, lean_lora(plain_lora_layers(model)):
        results = []
        for forward in (causal_lm_logits, transformers_logits):
            cache = DynamicCache(config=model.config)
            steps = [forward(model, ids, mask, positions_from_mask(mask.bool()), cache, logits_to_keep=1)]
            attention_mask, positions = mask, mask.sum(dim=1, keepdim=True)
            for token in range(3):
                attention_mask = torch.cat([attention_mask, torch.ones(3, 1, dtype=torch.long)], dim=1)
                steps.append(forward(model, torch.full((3, 1), 5 + token), attention_mask, positions + token, cache))
            results.append(steps)
    for lean, reference in zip(*results):
        if adapter == "disabled":
            assert torch.equal(lean, reference)
        else:
            torch.testing.assert_close(lean, reference, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
@pytest.mark.parametrize("grad", [False, True])
def test_in_bf16_the_logits_are_transformers_within_bf16_rounding(model_type, grad):
    """rms_norm rounds once where transformers rounds twice (its normalised value, then the product with the
    weight): the logits (|logit| < 1 here, where a bf16 ulp is at most 2^-8) differ by four ulps at most."""
    model = lora_model(CONFIGS[model_type]()).to(torch.bfloat16).eval()
    ids, mask = left_padded_batch()
    positions = positions_from_mask(mask.bool())
    with torch.set_grad_enabled(grad), lean_lora(plain_lora_layers(model)):
        lean = causal_lm_logits(model, ids, mask, positions).float()
        reference = transformers_logits(model, ids, mask, positions).float()
    assert reference.abs().max() < 1
    assert not torch.equal(lean, reference)  # the norms' weights round: a test that could tell
    torch.testing.assert_close(lean, reference, atol=2**-6, rtol=0)


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
@pytest.mark.parametrize("adapter", ["disabled", "unmerged"])
def test_in_bf16_the_training_forward_is_the_samplers_to_the_bit(model_type, adapter):
    """Under autograd and without it the norms are the same rms_norm, and a bf16 model's LoRA linears with fp32
    master weights compute the same ops in bf16 (A and s·B cast, the residual added by the base matmul:
    retrain/model/merged_lora.py): the trainer's logits are the sampler's, bit for bit."""
    model = bf16_with_fp32_adapters(lora_model(CONFIGS[model_type]())).eval()
    ids, mask = left_padded_batch()
    positions = positions_from_mask(mask.bool())
    disabled = model.disable_adapter if adapter == "disabled" else contextlib.nullcontext
    logits = []
    for grad in (False, True):
        with torch.set_grad_enabled(grad), disabled(), lean_lora(plain_lora_layers(model)):
            logits.append(causal_lm_logits(model, ids, mask, positions).detach())
    assert torch.equal(*logits)


def test_in_bf16_training_adds_each_residual_in_its_base_matmul():
    """A bf16 model's o and down projections add the residual in their base matmul under autograd as in sampling:
    two adds fewer per layer forward and none more in backward, and the LoRA gradients are those of the
    separate add within bf16's rounding."""
    model = bf16_with_fp32_adapters(lora_model(CONFIGS["qwen3"]())).train()
    ids, mask = left_padded_batch()
    positions = positions_from_mask(mask.bool())
    layers = plain_lora_layers(model)
    counted, gradients = [], []
    for fused in (True, False):
        model.zero_grad()
        with count_ops() as counts, lean_lora(layers):
            if not fused:  # the residual added apart: the layers' forward after the add's own op
                for layer in layers:
                    layer.forward = functools.partial(unfused_plus_linear_forward, layer.forward)
            causal_lm_logits(model, ids, mask, positions).float().square().mean().backward()
        counted.append(counts.compute)
        gradients.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    fused_ops, unfused_ops = counted
    assert unfused_ops["add"] - fused_ops["add"] == 2 * SIZES["num_hidden_layers"]
    assert fused_ops["addmm"] - unfused_ops["addmm"] == 2 * SIZES["num_hidden_layers"]
    assert (fused_ops - unfused_ops).keys() == {"addmm"}
    torch.testing.assert_close(gradients[0], gradients[1], rtol=0, atol=0.02 * gradients[1].abs().max().item())


def bf16_with_fp32_adapters(model: torch.nn.Module) -> torch.nn.Module:
    """The model in bf16, its LoRA master weights kept in fp32 as the trainer keeps them."""
    model.to(torch.bfloat16)
    for name, parameter in model.named_parameters():
        if ".lora_" in name:
            parameter.data = parameter.data.float()
    return model


def unfused_plus_linear_forward(forward, x, *args, **kwargs):
    """The lean layer's forward behind another function, so that plus_linear adds the residual in an op of its
    own (what it did under autograd before the residual went into the base matmul)."""
    return forward(x, *args, **kwargs)


def test_under_autograd_each_norm_is_one_fused_kernel_each_way_as_on_cuda():
    """The training forward's norms are torch's rms_norm, which CUDA runs as one kernel forward and one backward
    (counted as such: retrain/model/fused_counting.py), not transformers' eight ops and their backward."""
    model = lora_model(CONFIGS["qwen3"]()).train()
    ids, mask = left_padded_batch()
    with count_ops() as counts, lean_lora(plain_lora_layers(model)):
        logits = causal_lm_logits(model, ids, mask, positions_from_mask(mask.bool()))
        logits.sum().backward()
    norms = 4 * SIZES["num_hidden_layers"] + 1  # input, post-attention, q and k norms per layer; the final norm
    assert counts.compute["rms_norm"] == counts.compute["rms_norm_backward"] + 1 == norms  # the first input's: no grad
    assert "rsqrt" not in counts.compute and "pow" not in counts.compute


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_a_training_forward_gives_transformers_logits_and_gradients_to_the_bit(model_type):
    model = lora_model(CONFIGS[model_type]()).train()
    ids, mask = left_padded_batch()
    results = []
    for forward in (causal_lm_logits, transformers_logits):
        model.zero_grad()
        with lean_lora(plain_lora_layers(model)):
            logits = forward(model, ids, mask, positions_from_mask(mask.bool()), logits_to_keep=4)
        (logits * torch.linspace(-1, 1, logits.shape[-1])).sum().backward()
        grads = [p.grad.clone() for p in model.parameters() if p.requires_grad]
        results.append((logits.detach(), grads))
    (lean, lean_grads), (reference, reference_grads) = results
    assert torch.equal(lean, reference)
    assert all(torch.equal(a, b) for a, b in zip(lean_grads, reference_grads, strict=True))


def test_without_mask_or_positions_it_is_a_plain_causal_forward():
    """As the freshness probe calls it: one unpadded sequence, transformers' default positions."""
    model = lora_model(CONFIGS["qwen3"]()).eval()
    ids = torch.arange(3, 12).unsqueeze(0)
    with torch.inference_mode():
        assert torch.equal(
            causal_lm_logits(model, ids, logits_to_keep=2), transformers_logits(model, ids, logits_to_keep=2)
        )


@pytest.mark.parametrize(
    ("case", "config"),
    [
        (
            "sliding-window layers",
            lambda: Qwen2Config(**SIZES, use_sliding_window=True, max_window_layers=1, sliding_window=4),
        ),
        ("a sliding-window mask", lambda: MistralConfig(**SIZES, sliding_window=4)),
        ("an architecture it does not mirror", lambda: _gemma_config()),
    ],
)
def test_models_it_does_not_mirror_keep_transformers_forward(case, config):
    model = lora_model(config()).eval()
    assert LeanForward.of(model) is None, case
    ids, mask = left_padded_batch()
    with torch.inference_mode():
        lean = causal_lm_logits(model, ids, mask, positions_from_mask(mask.bool()))
        assert torch.equal(lean, transformers_logits(model, ids, mask, positions_from_mask(mask.bool())))


def test_eager_attention_keeps_transformers_forward():
    eager = lora_model(CONFIGS["llama"](), attention="eager")
    assert LeanForward.of(eager) is None  # its masks are additive floats, not sdpa's booleans


def checkpointed_step(model: torch.nn.Module, checkpointing: bool) -> tuple[torch.Tensor, list[torch.Tensor], int]:
    """A training forward and backward with the layers checkpointed or not: logits, gradients, and how many times
    the first layer's query projection ran (twice a step where backward recomputes the layer)."""
    causal_lm = model.base_model.model
    if checkpointing:
        enable_activation_checkpointing(causal_lm)
    else:
        causal_lm.gradient_checkpointing_disable()
    calls: list[int] = []
    hook = causal_lm.model.layers[0].self_attn.q_proj.register_forward_hook(lambda *_: calls.append(1))
    try:
        logits, grads = training_step(model.train())
    finally:
        hook.remove()
    return logits, grads, len(calls)


def training_step(model: torch.nn.Module) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One training forward through the lean forward and its backward, both with the LoRA linears routed as the
    trainer routes them (a checkpointed layer recomputes in backward): logits and the adapter's gradients."""
    device = model.device
    ids, mask = (tensor.to(device) for tensor in left_padded_batch())
    model.zero_grad()
    with lean_lora(plain_lora_layers(model)):
        logits = causal_lm_logits(model, ids, mask, positions_from_mask(mask.bool()))
        (logits.float() * torch.linspace(-1, 1, logits.shape[-1], device=device)).sum().backward()
    return logits.detach(), [p.grad.clone() for p in model.parameters() if p.requires_grad]


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_under_activation_checkpointing_the_lean_layers_recompute_to_the_bit(model_type):
    """Checkpointed, each layer runs through transformers' checkpointing function: backward recomputes the lean
    layer, and the logits and gradients are the unchecked forward's bits."""
    model = lora_model(CONFIGS[model_type]())
    enable_activation_checkpointing(model.base_model.model)
    assert not LeanForward.of(model.eval()).checkpointed  # nothing is recomputed outside training
    with torch.no_grad():
        assert not LeanForward.of(model.train()).checkpointed  # nor without autograd (the KL's base forward)
    assert LeanForward.of(model.train()).checkpointed
    (logits, grads, calls), (plain_logits, plain_grads, plain_calls) = (
        checkpointed_step(model, checkpointing) for checkpointing in (True, False)
    )
    assert (calls, plain_calls) == (2, 1)
    assert torch.equal(logits, plain_logits)
    assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads, strict=True))


def test_a_checkpointed_forward_refuses_to_fill_a_kv_cache():
    """A recomputed layer would write its keys and values a second time (transformers drops the cache instead)."""
    model = lora_model(CONFIGS["qwen3"]())
    enable_activation_checkpointing(model.base_model.model)
    ids, mask = left_padded_batch()
    with pytest.raises(ValueError, match="KV cache cannot be filled by layers that recompute"):
        causal_lm_logits(model.train(), ids, mask, positions_from_mask(mask.bool()), cache=DynamicCache())


@pytest.mark.parametrize(("past", "length"), [(0, 5), (4, 1), (4, 3), (0, 1)])
@pytest.mark.parametrize("padded", [True, False])
def test_the_mask_is_the_one_transformers_builds(past, length, padded):
    total = past + length
    attention_mask = torch.ones(2, total, dtype=torch.bool)
    if padded:
        attention_mask[1, :2] = False
    ours = sdpa_mask(attention_mask, 2, length, past, torch.device("cpu"))
    theirs = transformers_sdpa_mask(
        batch_size=2, q_length=length, kv_length=total, q_offset=past, attention_mask=attention_mask
    )
    if theirs is None:
        assert ours is None
    else:
        assert ours is not None and torch.equal(ours, theirs)


def _gemma_config():
    from transformers import GemmaConfig

    return GemmaConfig(**SIZES, head_dim=16)


def test_a_compiled_forward_survives_another_model_being_collected_while_it_compiles(monkeypatch):
    """torch.compile guards on what the traced code read; the lean forward's per-model look at the architecture
    once sat in a module-level weak dict, guarded key by key, and a model collected between the trace and the
    guards (CI's slow suite, its garbage collector at work) failed the compile. The window opened on purpose."""

    class Cycle:  # freed only by the cycle collector, i.e. at a moment nobody chooses
        def __init__(self, model):
            self.model, self.me = model, self

    def abandoned_model():
        model = lora_model(CONFIGS["qwen3"]())
        LeanForward.of(model)
        Cycle(model)

    model = lora_model(CONFIGS["qwen3"]())
    build_guards = torch._dynamo.guards.CheckFunctionManager.__init__

    def collect_then_build_guards(*args, **kwargs):
        gc.collect()
        return build_guards(*args, **kwargs)

    monkeypatch.setattr(torch._dynamo.guards.CheckFunctionManager, "__init__", collect_then_build_guards)
    torch._dynamo.reset()
    input_ids = torch.tensor([[3, 5, 7, 11]])
    gc.disable()  # the abandoned models live until the guards are built
    try:
        abandoned_model()
        abandoned_model()
        with torch.inference_mode(), lean_lora(plain_lora_layers(model)):
            eager = causal_lm_logits(model, input_ids)
            compiled = torch.compile(lambda ids: causal_lm_logits(model, ids), fullgraph=True)(input_ids)
    finally:
        gc.enable()
    torch.testing.assert_close(compiled, eager)
