"""backend=local construction: devices, dtypes, model specs, prompts, and the offline Hub error."""

from __future__ import annotations

import re
import time

import pytest
import torch
from huggingface_hub import constants

from retrain.backend.base import Backend
from retrain.backend.capabilities import capabilities_of, describe_backend
from retrain.backend.devices import resolve_device
from retrain.backend.local import LocalBackend
from retrain.errors import ConfigError, HubFetchError
from retrain.inference.base import InferenceEngine
from retrain.model.spec import ChatPrompts, ModelSpec
from tests.backend.tiny_model import PROMPTS, make_backend, make_engine, tokenizer_of


def test_backend_and_engine_satisfy_their_protocols_and_the_backend_declares_capabilities(tiny_spec):
    backend = make_backend(tiny_spec)
    engine = make_engine(backend)
    assert isinstance(backend, Backend) and isinstance(engine, InferenceEngine)
    assert not isinstance(backend, InferenceEngine)  # it does not sample itself: an engine samples beside it
    assert engine.model is backend.model  # the in-process engine shares the weights
    caps = capabilities_of(LocalBackend)
    assert caps.reports_sync_loss and caps.preserves_token_advantages and caps.returns_entropies
    assert caps.supports_checkpoint_resume and not caps.resume_runtime_dependent and not caps.samples_itself


def test_cpu_runs_in_fp32_and_lora_is_seeded(tiny_spec):
    first, same, other = (make_backend(tiny_spec, seed=s) for s in (5, 5, 6))
    assert first.device == torch.device("cpu") and first.model.dtype == torch.float32
    lora = [{n: p for n, p in b.model.named_parameters() if "lora_A" in n} for b in (first, same, other)]
    assert all(torch.equal(lora[0][n], lora[1][n]) for n in lora[0])
    assert not all(torch.equal(lora[0][n], lora[2][n]) for n in lora[0])


def test_trainable_parameters_summary(tiny_spec):
    summary = make_backend(tiny_spec).trainable_parameters
    match = re.fullmatch(r"trainable params: ([\d,]+) \|\| all params: ([\d,]+) \|\| trainable%: ([\d.]+)", summary)
    assert match, summary
    trainable, total = (int(match.group(i).replace(",", "")) for i in (1, 2))
    assert 0 < trainable < total


def test_chat_prompts_apply_the_chat_template_once_per_distinct_prompt(tiny_spec):
    tokenizer = tokenizer_of(tiny_spec.name_or_path)
    prompts = ChatPrompts(tokenizer, tiny_spec.name_or_path)
    encoded = prompts([PROMPTS[0], PROMPTS[1], PROMPTS[0]])
    assert len(encoded) == 3 and encoded[0] == encoded[2] and all(isinstance(t, int) for t in encoded[0])
    conversation = [{"role": "user", "content": PROMPTS[0]}]
    with_prompt, without = (
        tokenizer.apply_chat_template(conversation, add_generation_prompt=flag, tokenize=False)
        for flag in (True, False)
    )
    assert tokenizer.decode(encoded[0]) == with_prompt
    assert with_prompt.startswith(without) and len(with_prompt) > len(without)
    assert prompts([PROMPTS[0]])[0] is encoded[0]  # encoded once for the whole run


def test_a_tokenizer_without_chat_template_is_refused_by_name(tiny_spec):
    class Plain:
        chat_template = None

    with pytest.raises(ConfigError, match="model.name_or_path='my/base-model': its tokenizer has no chat template"):
        ChatPrompts(Plain(), "my/base-model")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the fallback only happens without CUDA")
def test_gpu_request_without_cuda_falls_back_to_cpu_with_a_warning(tiny_spec):
    with pytest.warns(RuntimeWarning, match="CUDA is not available"):
        backend = make_backend(tiny_spec, devices="gpu:0")
    assert backend.device == torch.device("cpu") and backend.model.dtype == torch.float32


@pytest.mark.parametrize(
    ("devices", "error", "message"),
    [
        ("gpu:0,gpu:1", ConfigError, "split mode"),
        ("tpu:0", ConfigError, "backend.devices='tpu:0'"),
        ("gpu:x", ConfigError, "is not 'cpu' or 'gpu:N'"),
        ("", ConfigError, "backend.devices=''"),
    ],
)
def test_bad_devices_are_named(devices, error, message):
    with pytest.raises(error, match=re.escape(message)):
        resolve_device(devices)


def test_negative_micro_batch_tokens_are_rejected():
    with pytest.raises(ValueError, match="backend.micro_batch_tokens"):
        describe_backend(LocalBackend).check_options({"micro_batch_tokens": -1})


class TestModelSpec:
    def test_alpha_zero_means_twice_the_rank(self):
        assert ModelSpec(lora_rank=16).effective_alpha == 32
        assert ModelSpec(lora_rank=16, lora_alpha=8).effective_alpha == 8

    def test_dtype_follows_the_device(self):
        assert ModelSpec().torch_dtype(torch.device("cpu")) == torch.float32
        assert ModelSpec().torch_dtype(torch.device("cuda", 0)) == torch.bfloat16
        assert ModelSpec(dtype="bf16").torch_dtype(torch.device("cpu")) == torch.bfloat16

    @pytest.mark.parametrize(
        ("field", "value"),
        [("lora_rank", 0), ("lora_alpha", -1), ("lora_dropout", 1.0), ("dtype", "int8"), ("target_modules", [])],
    )
    def test_bad_values_are_named(self, field, value):
        with pytest.raises(ValueError, match=f"model.{field}"):
            ModelSpec(**{field: value})

    def test_missing_bundled_asset_is_named(self):
        with pytest.raises(ConfigError, match="retrain:no_such_model"):
            ModelSpec(name_or_path="retrain:no_such_model").source()

    def test_missing_local_directory_is_named(self, tmp_path):
        with pytest.raises(ConfigError, match="no such file or directory"):
            ModelSpec(name_or_path=str(tmp_path / "absent")).source()

    def test_bundled_asset_and_local_directory_load_from_disk(self, tiny_spec, tiny_model_dir):
        assert tiny_spec.source() == (str(tiny_model_dir), False)
        assert ModelSpec(name_or_path=str(tiny_model_dir)).source() == (str(tiny_model_dir), False)

    def test_hub_id_is_not_a_local_path(self):
        assert ModelSpec(name_or_path="Qwen/Qwen3-4B-Instruct-2507").source() == ("Qwen/Qwen3-4B-Instruct-2507", True)


@pytest.mark.parametrize("offline_by", ["HF_HUB_OFFLINE", "unreachable endpoint"])
def test_uncached_hub_model_offline_fails_fast_and_points_at_quickstart(monkeypatch, tmp_path, offline_by):
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))  # nothing cached
    if offline_by == "HF_HUB_OFFLINE":
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    else:
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # discard port: refused at once
    started = time.monotonic()
    with pytest.raises(HubFetchError, match=r"(?s)'Qwen/Qwen3-4B-Instruct-2507'.*experiment=quickstart"):
        ModelSpec(name_or_path="Qwen/Qwen3-4B-Instruct-2507").load_tokenizer()
    assert time.monotonic() - started < 10
