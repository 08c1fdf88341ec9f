"""`inference.attention_kernel` of the pytorch engine: the names it takes, where each can run, and the same
logits whichever attention computes them (CPU: sdpa against eager; a GPU: flash, triton, cutlass)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from omegaconf import OmegaConf

from retrain.config import compose
from retrain.errors import ConfigError
from retrain.model.attention_kernels import attending_with
from retrain.model.lean_decoder import causal_lm_logits
from retrain.model.logprobs import left_pad
from retrain.model.probe import Probe
from retrain.model.rows import positions_from_mask
from retrain.types import SamplingParams
from tests.backend.tiny_model import PROMPTS, encode, make_backend, make_engine, tokenizer_of

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, top_p=1.0)
HAS_GPU = torch.cuda.is_available()


@pytest.mark.parametrize(
    ("kernel", "message"),
    [
        ("tk", "inference.attention_kernel=tk: transformers has no ThunderKittens attention for inference=pytorch"),
        ("flashy", "inference.attention_kernel='flashy' is not one of default, flash, triton, cutlass"),
    ],
)
def test_a_kernel_the_engine_has_not_is_refused_with_the_config(kernel: str, message: str) -> None:
    cfg = compose(["experiment=quickstart", f"inference.attention_kernel={kernel}"])
    with pytest.raises(ConfigError) as refused:
        OmegaConf.to_object(cfg.inference)
    assert str(refused.value).startswith(message)


@pytest.mark.parametrize("kernel", ["flash", "triton", "cutlass"])
def test_a_gpu_kernel_is_refused_on_cpu_naming_the_key(tiny_spec, kernel: str) -> None:
    with pytest.raises(ConfigError) as refused:
        make_engine(make_backend(tiny_spec), attention_kernel=kernel)
    assert str(refused.value) == (
        f"inference.attention_kernel={kernel} needs a CUDA GPU, but the engine samples on cpu (backend.devices); "
        "on cpu keep inference.attention_kernel=default"
    )


def test_sdpa_and_eager_give_the_same_logits_and_samples_on_cpu(tiny_spec) -> None:
    backend = make_backend(tiny_spec)
    model, own = backend.model, backend.model.get_base_model().config._attn_implementation
    prompts, mask = left_pad(encode(backend, PROMPTS), 0, torch.device("cpu"))  # padded rows: the mask matters
    with torch.no_grad():
        sdpa = causal_lm_logits(model, prompts, mask.long(), positions_from_mask(mask))
        with attending_with(model, "eager"):
            assert model.get_base_model().config._attn_implementation == "eager"
            eager = causal_lm_logits(model, prompts, mask.long(), positions_from_mask(mask))
    assert model.get_base_model().config._attn_implementation == own  # training attends as before
    assert torch.allclose(sdpa[mask], eager[mask], atol=1e-5, rtol=1e-5)
    engine = make_engine(backend)
    default = engine.generate(encode(backend, PROMPTS), 2, GREEDY, generator_seed=None)
    with attending_with(model, "eager"):
        eager_rollouts = engine.generate(encode(backend, PROMPTS), 2, GREEDY, generator_seed=None)
    assert torch.equal(default.completion_ids, eager_rollouts.completion_ids)
    assert torch.allclose(default.logprobs, eager_rollouts.logprobs, atol=1e-5)


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    "kernel",
    [
        pytest.param("flash", marks=pytest.mark.skipif(not installed("flash_attn"), reason="flash-attn not installed")),
        pytest.param("triton", marks=pytest.mark.skipif(not installed("triton"), reason="triton not installed")),
        "cutlass",
    ],
)
def test_a_gpu_kernel_samples_what_the_default_samples(tiny_spec, kernel: str) -> None:
    """In bf16 each kernel rounds its own way (on the H200 the triton kernel's probe log-probs were 0.06 from the
    default's, on average): the chosen kernel is as close to the same model in fp32 as the default kernel is."""
    from dataclasses import replace

    backend = make_backend(replace(tiny_spec, dtype="bf16"), devices="gpu:0")
    own = backend.model.get_base_model().config._attn_implementation
    default, chosen = make_engine(backend), make_engine(backend, attention_kernel=kernel)
    probe = Probe.from_tokenizer(tokenizer_of(backend.spec.name_or_path))
    exact = make_engine(make_backend(replace(tiny_spec, dtype="fp32"), devices="gpu:0")).probe_logprobs(probe)
    default_error = (default.probe_logprobs(probe) - exact).abs().mean()
    chosen_error = (chosen.probe_logprobs(probe) - exact).abs().mean()
    assert chosen_error <= 2 * default_error + 1e-2, (chosen_error, default_error)
    rollouts = chosen.generate(encode(backend, PROMPTS), 2, GREEDY, generator_seed=None)
    assert rollouts.completion_mask.any(dim=1).all()
    assert backend.model.get_base_model().config._attn_implementation == own
