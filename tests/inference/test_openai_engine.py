"""inference=openai against loopback OpenAI-compatible servers that lack n, token prompts or LoRA routes."""

from __future__ import annotations

import logging

import pytest
import torch

from retrain.errors import ConfigError
from retrain.inference import openai_server, vllm_server
from retrain.inference.completions import request_seed
from retrain.inference.config import OpenAIEngineConfig
from retrain.inference.finish_reason import hit_max_tokens
from retrain.inference.http import HttpError
from retrain.inference.openai_server import OpenAIEngine, ServerFeatures
from retrain.model.probe import Probe, StaleWeightsError
from retrain.types import SamplingParams
from tests.backend.tiny_model import PROMPTS, encode, make_backend, tokenizer_of
from tests.inference.fake_servers import ServedModel, moved, openai_routes, trainer_logprobs
from tests.inference.loopback import serve

SAMPLING = SamplingParams(max_tokens=6, temperature=1.0, top_p=1.0)
BARE = {"n": False, "token_prompts": False, "token_ids": False, "lora": False}  # e.g. MLX-LM, MAX
FULL = {"n": True, "token_prompts": True, "token_ids": True, "lora": True}  # vLLM's extensions


@pytest.fixture(scope="module")
def served_model():
    return ServedModel()


@pytest.fixture
def fresh_model(served_model):
    served_model.adapters.clear()
    return served_model


@pytest.fixture
def backend(tiny_spec):
    return make_backend(tiny_spec)


def engine_on(server, backend, **options) -> OpenAIEngine:
    return OpenAIEngine(
        OpenAIEngineConfig(url=server.url, **options),
        tokenizer=tokenizer_of(backend.spec.name_or_path),
        resources=backend.engine_resources(),
    )


def test_a_bare_server_gets_text_prompts_and_one_request_per_completion(fresh_model, backend):
    tokenizer = tokenizer_of(backend.spec.name_or_path)
    with serve(openai_routes(fresh_model, tokenizer, **BARE)) as server:
        engine = engine_on(server, backend)
        assert engine.features == ServerFeatures(token_prompts=False, token_ids=False, n=False, lora_routes=False)
        assert engine.model == "tiny" and engine.adapters is None
        server.requests.clear()
        prompts = encode(backend, PROMPTS[:2])
        rollouts = engine.generate(prompts, 3, SAMPLING, generator_seed=4)
        engine.close()
    asked = [request.body for request in server.asked("/v1/completions")]  # in the order they arrived
    assert len(asked) == 6 and all(body["n"] == 1 and body["model"] == "tiny" for body in asked)
    expected = [(tokenizer.decode(p), request_seed(4, b) + g) for b, p in enumerate(prompts) for g in range(3)]
    assert sorted((body["prompt"], body["seed"]) for body in asked) == sorted(expected)
    # ids re-tokenized from the returned token texts (exact for this byte-level tokenizer)
    gap = (trainer_logprobs(backend, rollouts) - rollouts.logprobs)[rollouts.completion_mask].abs().max()
    assert gap < 1e-4


def test_frozen_weights_stop_the_run_at_the_first_sync(fresh_model, backend, caplog):
    tokenizer = tokenizer_of(backend.spec.name_or_path)
    with serve(openai_routes(fresh_model, tokenizer, **BARE)) as server:
        engine = engine_on(server, backend)
        with pytest.raises(StaleWeightsError, match=f"server at {server.url} has no runtime-LoRA route.*frozen"):
            engine.sync(moved(backend))
        engine.close()
        hooked = engine_on(server, backend, fault_skip_weight_sync=True)
        with caplog.at_level(logging.WARNING):
            hooked.sync(moved(backend, seed=1))  # the test hook only warns: the freshness proof must fire
        assert "fault_skip_weight_sync" in caplog.text and hooked.weights_version == 0
        hooked.close()


def test_a_server_without_n_but_with_token_prompts_and_token_ids(fresh_model, backend):
    tokenizer = tokenizer_of(backend.spec.name_or_path)
    with serve(openai_routes(fresh_model, tokenizer, **{**FULL, "n": False, "lora": False})) as server:
        engine = engine_on(server, backend)
        assert engine.features == ServerFeatures(token_prompts=True, token_ids=True, n=False, lora_routes=False)
        server.requests.clear()
        prompts = encode(backend, PROMPTS[:2])
        rollouts = engine.generate(prompts, 2, SAMPLING, generator_seed=9)
        engine.close()
    asked = [request.body for request in server.asked("/v1/completions")]
    assert sorted(body["prompt"] for body in asked) == sorted(p for p in prompts for _ in range(2))
    assert all(body["return_token_ids"] and tokenizer.eos_token_id in body["stop_token_ids"] for body in asked)
    gap = (trainer_logprobs(backend, rollouts) - rollouts.logprobs)[rollouts.completion_mask].abs().max()
    assert gap < 1e-4


def test_a_server_with_n_and_lora_routes_follows_training(fresh_model, backend):
    tokenizer = tokenizer_of(backend.spec.name_or_path)
    with serve(openai_routes(fresh_model, tokenizer, **FULL)) as server:
        engine = engine_on(server, backend)
        assert engine.features == ServerFeatures(token_prompts=True, token_ids=True, n=True, lora_routes=True)
        server.requests.clear()
        prompts = encode(backend, PROMPTS[:2])
        rollouts = engine.generate(prompts, 3, SAMPLING, generator_seed=2)
        asked = [request.body for request in server.asked("/v1/completions")]
        assert sorted((body["n"], body["seed"], body["model"]) for body in asked) == sorted(
            (3, request_seed(2, b), "policy-v0") for b in range(2)
        )
        assert rollouts.num_rows == 6

        probe = Probe.from_tokenizer(tokenizer)
        engine.sync(moved(backend))
        assert engine.weights_version == 1 and sorted(fresh_model.adapters) == ["policy-v1"]
        assert torch.allclose(engine.probe_logprobs(probe), backend.probe_logprobs(probe), atol=1e-4)
        engine.close()


def test_a_server_without_logprobs_is_refused_at_start(fresh_model, backend):
    routes = openai_routes(fresh_model, tokenizer_of(backend.spec.name_or_path), **BARE)
    answer = routes["POST /v1/completions"]

    def without_logprobs(body):
        status, payload, headers = answer(body)
        for choice in payload.get("choices", []):
            choice["logprobs"] = None
        return status, payload, headers

    routes["POST /v1/completions"] = without_logprobs
    with serve(routes) as server, pytest.raises(ConfigError, match="answers no log-probs"):
        engine_on(server, backend)


def test_nucleus_sampling_warns_once_that_the_ratio_reads_below_one(fresh_model, backend, caplog):
    tokenizer = tokenizer_of(backend.spec.name_or_path)
    nucleus = SamplingParams(max_tokens=4, temperature=1.0, top_p=0.9)
    with serve(openai_routes(fresh_model, tokenizer, **BARE)) as server, caplog.at_level(logging.WARNING, "retrain"):
        engine = engine_on(server, backend)
        for _ in range(2):
            engine.generate(encode(backend, PROMPTS[:2]), 2, nucleus, generator_seed=1)
        engine.close()
    warnings = [r.getMessage() for r in caplog.records if "renormalised nucleus" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith("training.top_p=0.9: the server reports log-probs"), warnings


def test_an_aborted_completion_stops_the_run_as_on_vllm_server(fresh_model, backend):
    routes = openai_routes(fresh_model, tokenizer_of(backend.spec.name_or_path), **BARE)
    answer = routes["POST /v1/completions"]
    aborting = {"on": False}

    def abort_when_asked(body):
        status, payload, headers = answer(body)
        if aborting["on"]:
            payload["choices"][-1]["finish_reason"] = "abort"
        return status, payload, headers

    routes["POST /v1/completions"] = abort_when_asked
    with serve(routes) as server:
        engine = engine_on(server, backend)
        aborting["on"] = True
        try:
            with pytest.raises(HttpError, match=r"finish_reason='abort': the server aborted it mid-generation"):
                engine.generate(encode(backend, PROMPTS[:1]), 2, SAMPLING, generator_seed=0)
        finally:
            engine.close()


def test_both_server_engines_read_finish_reasons_alike():
    assert hit_max_tokens("http://x/v1/completions", "length") and not hit_max_tokens("http://x", "stop")
    with pytest.raises(HttpError, match="'abort'"):
        hit_max_tokens("http://x/v1/completions", "abort")
    assert vllm_server.hit_max_tokens is openai_server.hit_max_tokens
