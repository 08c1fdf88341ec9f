"""The freshness proof on real engines: passes on the weights just trained, fires on any other weights."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from retrain.inference.config import PytorchEngineConfig
from retrain.inference.pytorch import PytorchEngine
from retrain.model.probe import PROBE_TEXT, Probe, StaleWeightsError, probe_tolerance
from retrain.model.resources import EngineResources
from retrain.training.freshness import FreshnessProof
from retrain.types import SamplingParams, TrainBatch
from tests.backend.tiny_model import PROMPTS, encode, make_backend, make_engine, tokenizer_of


def trained_one_step(backend):
    """One real optimizer step on the tiny model; returns its WeightUpdate."""
    engine = make_engine(backend)
    rollouts = engine.generate(encode(backend, PROMPTS), 4, SamplingParams(max_tokens=6), 0)
    advantages = torch.randn(rollouts.completion_ids.shape, generator=torch.Generator().manual_seed(0))
    update = backend.train(
        TrainBatch(rollouts, advantages * rollouts.completion_mask, torch.ones(rollouts.num_rows, dtype=torch.bool))
    ).update
    assert update is not None and update.version == 1
    return update


def engine_with_its_own_model(spec, backend):
    """A real PytorchEngine holding a separate copy of the model, as a remote engine would."""
    model = make_backend(spec, seed=7).model
    return PytorchEngine(
        PytorchEngineConfig(),
        tokenizer=tokenizer_of(spec.name_or_path),
        resources=EngineResources(spec=spec, device=backend.device, model=model),
    )


def test_the_probe_is_a_prompt_and_a_two_token_continuation(tiny_spec):
    tokenizer = tokenizer_of(tiny_spec.name_or_path)
    probe = Probe.from_tokenizer(tokenizer)
    assert len(probe.completion_ids) == 2 and probe.prompt_ids
    assert tokenizer.decode(probe.prompt_ids + probe.completion_ids) == PROBE_TEXT


def test_both_paths_agree_on_the_shared_model(tiny_spec):
    backend = make_backend(tiny_spec, lr=0.1)
    probe = Probe.from_tokenizer(tokenizer_of(tiny_spec.name_or_path))
    engine = make_engine(backend)
    proof = FreshnessProof(probe, backend)
    assert proof.check(engine, 0).gap_old is None  # the initial adapter: nothing older to compare with
    update = trained_one_step(backend)
    engine.sync(update)
    served, trained = engine.probe_logprobs(probe), backend.probe_logprobs(probe)
    assert served.shape == trained.shape == (2,) and (served < 0).all()
    result = proof.check(engine, update.version)
    assert result.gap <= probe_tolerance(torch.float32)
    assert result.shift is not None and result.gap_old is not None
    assert result.shift > 0.01 and result.gap_old > 100 * result.gap  # far closer to the new weights
    assert set(result.metrics()) == {"engine/probe_gap", "engine/probe_gap_old", "engine/probe_shift"}


def test_in_bf16_both_paths_score_the_probe_to_the_bit(tiny_spec):
    """In bf16 the engine's probe once ran a prefill and a cached step, the trainer's one forward: with a
    non-zero adapter their roundings drifted up to 0.05 apart, and a fresh engine failed the proof (seen at
    step 1 of `experiment=quickstart algorithm=grpo_none model.dtype=bf16 training.seed=1`)."""
    backend = make_backend(dataclasses.replace(tiny_spec, dtype="bf16"), lr=3e-3)
    probe = Probe.from_tokenizer(tokenizer_of(tiny_spec.name_or_path))
    engine = make_engine(backend)
    proof = FreshnessProof(probe, backend)
    proof.check(engine, 0)
    update = trained_one_step(backend)
    engine.sync(update)
    result = proof.check(engine, update.version)
    assert result.gap == 0.0 and result.shift is not None and result.shift > 0


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_an_engine_serving_other_weights_is_stale_until_it_syncs(tiny_spec, dtype):
    spec = dataclasses.replace(tiny_spec, dtype=dtype)
    backend = make_backend(spec, lr=0.5)
    probe = Probe.from_tokenizer(tokenizer_of(spec.name_or_path))
    engine = engine_with_its_own_model(spec, backend)
    proof = FreshnessProof(probe, backend)
    proof.check(engine, 0)
    update = trained_one_step(backend)
    with pytest.raises(StaleWeightsError, match="serves stale weights: after the sync to weights version 1"):
        proof.check(engine, update.version)  # the new adapter never reached its model
    engine.sync(update)
    assert proof.check(engine, update.version).gap <= backend.probe_tolerance


def test_an_update_smaller_than_the_tolerance_still_proves_an_engine_stale(tiny_spec):
    """Old vs new: the engine that kept the old weights is within the tolerance of the new ones, yet
    it is much closer to the old weights, and that is what fails it."""
    backend = make_backend(tiny_spec, lr=3e-5)
    probe = Probe.from_tokenizer(tokenizer_of(tiny_spec.name_or_path))
    engine = make_engine(backend, fault_skip_weight_sync=True)
    proof = FreshnessProof(probe, backend)
    proof.check(engine, 0)
    update = trained_one_step(backend)
    engine.sync(update)  # skipped by the fault hook
    served, trained = engine.probe_logprobs(probe), backend.probe_logprobs(probe)
    assert 0 < float((served - trained).abs().mean()) <= probe_tolerance(torch.float32)
    with pytest.raises(StaleWeightsError, match="from the previous weights"):
        proof.check(engine, update.version)


def test_the_fault_hook_keeps_the_shared_model_training(tiny_spec):
    """The hook swaps the frozen adapter in only while sampling: the backend still trains its own weights."""
    backend = make_backend(tiny_spec, lr=0.5)
    engine = make_engine(backend, fault_skip_weight_sync=True)
    probe = Probe.from_tokenizer(tokenizer_of(tiny_spec.name_or_path))
    before = backend.probe_logprobs(probe)
    update = trained_one_step(backend)
    engine.sync(update)
    untrained = engine_with_its_own_model(tiny_spec, backend)
    assert torch.equal(engine.probe_logprobs(probe), untrained.probe_logprobs(probe))  # still the initial adapter
    assert not torch.allclose(backend.probe_logprobs(probe), before)


def test_tolerance_follows_the_training_dtype():
    assert probe_tolerance(torch.float32) == 1e-3
    assert probe_tolerance(torch.bfloat16) == probe_tolerance(torch.float16) == 0.1
