"""inference=vllm's config → vllm.LLM arguments: pure functions, no vLLM needed (the engine imports it lazily)."""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys

import pytest
import torch

from retrain.errors import ConfigError
from retrain.inference.config import VllmEngineConfig
from retrain.inference.vllm import (
    VLLM_LORA_RANKS,
    engine_arguments,
    lora_rank_for_vllm,
    quiet_vllm_logging,
    serving_tolerance,
)
from retrain.model.resources import EngineResources
from retrain.model.spec import ModelSpec
from tests.conftest import REPO

SPEC = ModelSpec(name_or_path="retrain:tiny_qwen3", lora_rank=4)
CPU = EngineResources(spec=SPEC, device=torch.device("cpu"))
CUDA = EngineResources(spec=SPEC, device=torch.device("cuda"))  # a device object; no GPU is touched


@pytest.mark.parametrize(
    ("rank", "served"), [(1, 1), (2, 8), (4, 8), (8, 8), (9, 16), (64, 64), (65, 128), (257, 320), (321, 512)]
)
def test_lora_rank_rounds_up_to_a_rank_vllm_allows(rank: int, served: int) -> None:
    assert lora_rank_for_vllm(rank) == served and served in VLLM_LORA_RANKS


def test_a_lora_rank_beyond_vllms_largest_names_the_key() -> None:
    with pytest.raises(ConfigError, match=r"model.lora_rank=513 exceeds vLLM's largest max_lora_rank 512"):
        lora_rank_for_vllm(513)


def test_defaults_on_cpu_serve_the_training_dtype_eagerly_with_processed_logprobs() -> None:
    arguments = engine_arguments(VllmEngineConfig(), CPU)
    assert arguments["model"] == SPEC.source()[0] and arguments["enable_lora"]
    assert arguments["dtype"] == "float32" and arguments["kv_cache_dtype"] == "auto"
    assert arguments["max_lora_rank"] == 8  # model.lora_rank=4, rounded up
    assert arguments["logprobs_mode"] == "processed_logprobs"  # log_softmax(logits / T), what the trainer computes
    assert arguments["generation_config"] == "vllm"  # no sampling defaults taken from the model's files
    assert arguments["enforce_eager"] and arguments["enable_prefix_caching"]
    assert "max_model_len" not in arguments and "attention_backend" not in arguments
    assert "gpu_memory_utilization" not in arguments and "enable_sleep_mode" not in arguments


def test_merged_weights_start_vllm_without_lora() -> None:
    arguments = engine_arguments(VllmEngineConfig(merge_lora=True), CPU)
    assert arguments["enable_lora"] is False
    assert "max_lora_rank" not in arguments and "max_loras" not in arguments


@pytest.mark.parametrize(
    ("keys", "tolerance"),
    [
        ({}, 1e-3),  # auto: the fp32 training dtype on CPU
        ({"dtype": "fp32"}, 1e-3),
        ({"dtype": "bf16"}, 0.1),
        ({"dtype": "fp16"}, 0.1),
        ({"dtype": "fp8"}, 0.1),
        ({"kv_cache_dtype": "fp8"}, 0.1),  # fp32 weights, a coarser KV cache
    ],
)
def test_the_proof_tolerance_follows_what_vllm_computes_in(keys: dict[str, str], tolerance: float) -> None:
    assert serving_tolerance(engine_arguments(VllmEngineConfig(**keys), CPU)) == tolerance


def test_keys_map_to_vllms_arguments() -> None:
    config = VllmEngineConfig(
        dtype="fp8",
        kv_cache_dtype="int8",
        prefix_caching=False,
        attention_kernel="flash",
        gpu_memory_utilization=0.5,
        max_model_len=2048,
        max_lora_rank=32,
        sleep_mode=False,
    )
    arguments = engine_arguments(config, CUDA)
    assert arguments["dtype"] == "bfloat16" and arguments["quantization"] == "fp8"
    assert arguments["kv_cache_dtype"] == "int8_per_token_head"
    assert arguments["attention_backend"] == "FLASH_ATTN"
    assert arguments["gpu_memory_utilization"] == 0.5 and arguments["enable_sleep_mode"] is False
    assert arguments["max_model_len"] == 2048 and arguments["max_lora_rank"] == 32
    assert not arguments["enable_prefix_caching"] and not arguments["enforce_eager"]
    assert engine_arguments(VllmEngineConfig(), CUDA)["dtype"] == "bfloat16"  # auto: the training dtype on GPU


@pytest.mark.parametrize(
    ("keys", "resources", "message"),
    [
        ({"dtype": "fp4"}, CPU, r"inference.dtype=fp4: vLLM serves fp4 only from a checkpoint quantized ahead"),
        ({"dtype": "int3"}, CPU, r"inference.dtype='int3' is not one of"),
        ({"attention_kernel": "tk"}, CPU, r"inference.attention_kernel=tk: vLLM has no ThunderKittens"),
        ({"attention_kernel": "flash"}, CPU, r"inference.attention_kernel=flash needs a GPU"),
        ({"attention_kernel": "flashinfer"}, CUDA, r"inference.attention_kernel='flashinfer' is not one of"),
        ({"kv_cache_dtype": "bad"}, CPU, r"inference.kv_cache_dtype='bad' is not one of"),
        ({"max_model_len": -1}, CPU, r"inference.max_model_len must be >= 0"),
        ({"gpu_memory_utilization": 0.0}, CUDA, r"inference.gpu_memory_utilization must be in \(0, 1\]"),
        ({"gpu_memory_utilization": 1.5}, CUDA, r"inference.gpu_memory_utilization must be in \(0, 1\]"),
    ],
)
def test_a_bad_value_is_a_config_error_naming_its_key(keys: dict, resources: EngineResources, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        engine_arguments(VllmEngineConfig(**keys), resources)


def test_the_engine_module_imports_vllm_only_when_an_engine_starts() -> None:
    """So config errors come before vLLM's slow import, and runs without vLLM never import it."""
    script = "import sys, retrain.inference.vllm; assert 'vllm' not in sys.modules, 'vllm imported'"
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


NOISY = "To use this feature, torch.set_num_threads is disabled (a no-op) in the CPU worker"


@pytest.mark.parametrize(("asked", "level", "filtered"), [(None, "WARNING", True), ("INFO", "INFO", False)])
def test_vllm_chatter_stays_off_the_console_unless_asked(
    monkeypatch: pytest.MonkeyPatch, asked: str | None, level: str, filtered: bool
) -> None:
    if asked is None:
        monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    else:
        monkeypatch.setenv("VLLM_LOGGING_LEVEL", asked)
    logger = logging.getLogger("retrain-test-vllm")  # a logger set up as vLLM sets up its own: a console handler
    shown = io.StringIO()
    handler = logging.StreamHandler(shown)
    logger.addHandler(handler)
    logger.propagate = False
    try:
        quiet_vllm_logging("retrain-test-vllm")
        quiet_vllm_logging("retrain-test-vllm")  # the second call (after vLLM's import) adds no second filter
        assert os.environ["VLLM_LOGGING_LEVEL"] == level
        for _ in range(3):
            logger.warning(NOISY)
        logger.warning("KV cache is full")
    finally:
        logger.removeHandler(handler)
    expected = ["KV cache is full"] if filtered else [NOISY] * 3 + ["KV cache is full"]
    assert shown.getvalue().splitlines() == expected and len(handler.filters) == int(filtered)
