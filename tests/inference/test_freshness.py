"""The freshness proof on real engines: passes on the weights just trained, fires on any other weights."""

from __future__ import annotations

import pytest
import torch

from retrain.inference.base import EngineResources, StaleWeightsError
from retrain.inference.freshness import PROBE_TEXT, Probe, check_fresh, probe_tolerance
from retrain.inference.pytorch import PytorchEngine
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
        tokenizer_of(spec.name_or_path), EngineResources(spec=spec, device=backend.device, model=model)
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
    update = trained_one_step(backend)
    engine.sync(update)
    served, trained = engine.probe_logprobs(probe), backend.probe_logprobs(probe)
    assert served.shape == trained.shape == (2,) and (served < 0).all()
    assert check_fresh(engine, backend, probe, update.version) <= probe_tolerance(torch.float32)


def test_an_engine_serving_other_weights_is_stale_until_it_syncs(tiny_spec):
    backend = make_backend(tiny_spec, lr=0.5)
    probe = Probe.from_tokenizer(tokenizer_of(tiny_spec.name_or_path))
    engine = engine_with_its_own_model(tiny_spec, backend)
    update = trained_one_step(backend)
    with pytest.raises(StaleWeightsError, match="serves stale weights: after the sync to weights version 1"):
        check_fresh(engine, backend, probe, update.version)  # the new adapter never reached its model
    engine.sync(update)
    assert check_fresh(engine, backend, probe, update.version) <= probe_tolerance(torch.float32)


def test_tolerance_follows_the_training_dtype():
    assert probe_tolerance(torch.float32) == 1e-3
    assert probe_tolerance(torch.bfloat16) == probe_tolerance(torch.float16) == 0.1
