"""inference=sglang against a loopback server speaking SGLang's native API with the real tiny model."""

from __future__ import annotations

import logging

import pytest
import torch

from retrain.errors import ConfigError
from retrain.inference.adapters import AdapterPublisher
from retrain.inference.completions import request_seed
from retrain.inference.config import SglangEngineConfig
from retrain.inference.sglang import SglangEngine
from retrain.model.probe import Probe, StaleWeightsError
from retrain.types import SamplingParams, WeightUpdate
from tests.backend.tiny_model import PROMPTS, encode, make_backend, tokenizer_of
from tests.inference.fake_servers import ServedModel, moved, sglang_routes, trainer_logprobs
from tests.inference.loopback import serve

SAMPLING = SamplingParams(max_tokens=6, temperature=1.0, top_p=1.0)


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


@pytest.fixture
def server(fresh_model):
    with serve(sglang_routes(fresh_model)) as loopback:
        yield loopback


def engine_on(server, backend, **options) -> SglangEngine:
    return SglangEngine(
        SglangEngineConfig(url=server.url, **options),
        tokenizer=tokenizer_of(backend.spec.name_or_path),
        resources=backend.engine_resources(),
    )


def test_rollouts_are_group_major_with_the_trainers_logprobs(server, backend):
    engine = engine_on(server, backend)
    prompts = encode(backend, PROMPTS)
    rollouts = engine.generate(prompts, 3, SAMPLING, generator_seed=11)
    assert rollouts.completion_ids.shape[0] == len(PROMPTS) * 3 and rollouts.group_size == 3
    gap = (trainer_logprobs(backend, rollouts) - rollouts.logprobs)[rollouts.completion_mask].abs().max()
    assert gap < 1e-4  # each row was scored under its own prompt: the rows are group-major
    assert len(rollouts.texts) == 12 and rollouts.hit_max_tokens.shape == (12,)
    engine.close()


def test_every_request_is_explicit_seeded_and_names_the_served_adapter(server, backend):
    engine = engine_on(server, backend)
    prompts = encode(backend, PROMPTS[:2])
    engine.generate(prompts, 2, SamplingParams(max_tokens=4, temperature=0.7, top_p=0.9), generator_seed=5)
    asked = sorted(server.asked("/generate"), key=lambda request: prompts.index(request.body["input_ids"][0]))
    assert len(asked) == 2  # one request per prompt (they arrive in any order)
    for index, request in enumerate(asked):
        body = request.body
        assert body["input_ids"] == [prompts[index]] * 2 and body["return_logprob"] is True
        assert body["lora_path"] == ["policy-v0", "policy-v0"]
        seed = request_seed(5, index)
        assert [params["sampling_seed"] for params in body["sampling_params"]] == [seed, seed + 1]
        params = body["sampling_params"][0]
        assert (params["temperature"], params["top_p"], params["max_new_tokens"]) == (0.7, 0.9, 4)
        assert (params["top_k"], params["min_p"], params["repetition_penalty"]) == (-1, 0.0, 1.0)
        assert engine.tokenizer.eos_token_id in params["stop_token_ids"]
    engine.close()


def test_same_seed_same_rollouts_and_greedy_repeats(server, backend):
    engine = engine_on(server, backend)
    prompts = encode(backend, PROMPTS[:2])
    first, again = (engine.generate(prompts, 2, SAMPLING, 3) for _ in range(2))
    assert torch.equal(first.completion_ids, again.completion_ids)
    greedy = engine.generate(prompts, 2, SamplingParams(max_tokens=5, temperature=0.0), None)
    assert torch.equal(greedy.completion_ids[0::2], greedy.completion_ids[1::2])
    engine.close()


def test_sync_serves_a_new_name_and_the_probe_follows_the_weights(server, backend, fresh_model):
    engine = engine_on(server, backend)
    probe = Probe.from_tokenizer(engine.tokenizer)
    before = engine.probe_logprobs(probe)
    assert torch.allclose(before, backend.probe_logprobs(probe), atol=1e-4)

    engine.sync(moved(backend))
    assert engine.weights_version == 1 and sorted(fresh_model.adapters) == ["policy-v1"]
    assert [r.body["lora_name"] for r in server.asked("/unload_lora_adapter")] == ["policy-v0"]
    after = engine.probe_logprobs(probe)
    assert torch.allclose(after, backend.probe_logprobs(probe), atol=1e-4)
    assert (after - before).abs().max() > 1e-2
    with pytest.raises(StaleWeightsError, match="version 0.*already serves version 1"):
        engine.sync(WeightUpdate(version=0, tensors=backend.adapter))
    engine.close()


def test_the_fault_hook_pushes_nothing_so_the_probe_keeps_the_old_weights(server, backend, caplog):
    engine = engine_on(server, backend, fault_skip_weight_sync=True)
    probe = Probe.from_tokenizer(engine.tokenizer)
    old = engine.probe_logprobs(probe)
    with caplog.at_level(logging.WARNING):
        engine.sync(moved(backend))
    assert "fault_skip_weight_sync" in caplog.text and engine.weights_version == 0
    assert len(server.asked("/load_lora_adapter")) == 1  # version 0 only
    served = engine.probe_logprobs(probe)
    assert torch.equal(served, old)
    assert (served - backend.probe_logprobs(probe)).abs().mean() > 1e-2  # what the freshness proof catches
    engine.close()


def test_a_name_left_on_the_server_is_replaced_not_reused(server, backend, fresh_model, tiny_spec, tmp_path):
    stale = make_backend(tiny_spec, seed=1)
    publisher = AdapterPublisher(tiny_spec, tmp_path)
    fresh_model.load("policy-v0", str(publisher.publish(moved(stale, seed=3))))  # an earlier run's adapter
    engine = engine_on(server, backend)
    probe = Probe.from_tokenizer(engine.tokenizer)
    assert torch.allclose(engine.probe_logprobs(probe), backend.probe_logprobs(probe), atol=1e-4)
    assert [r.body["lora_name"] for r in server.asked("/unload_lora_adapter")] == ["policy-v0"]
    engine.close()


def test_close_unloads_the_adapter_and_removes_its_directories(server, backend, fresh_model):
    engine = engine_on(server, backend)
    root = engine.adapters.publisher.root
    assert (root / "policy-v0" / "adapter_config.json").is_file()
    engine.close()
    assert fresh_model.adapters == {} and not root.exists()


def test_a_server_without_lora_routes_gets_a_clear_error(fresh_model, backend):
    with (
        serve(sglang_routes(fresh_model, lora=False)) as server,
        pytest.raises(ConfigError, match="SGLang at http://127.0.0.1:[0-9]+ has no runtime-LoRA route.*--enable-lora"),
    ):
        engine_on(server, backend)


def test_an_adapter_the_server_cannot_read_is_named(server, backend, fresh_model):
    def unreadable(body):
        return 400, {"success": False, "error_message": f"No adapter found for {body['lora_path']}"}, {}

    server.routes["POST /load_lora_adapter"] = unreadable
    with pytest.raises(ConfigError, match="could not load policy-v0 from .*inference.adapter_root"):
        engine_on(server, backend)


def test_an_adapter_root_that_cannot_be_a_directory_is_named(server, backend, tmp_path):
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ConfigError, match="inference.adapter_root='.*a_file': cannot be a directory: .*File exists"):
        engine_on(server, backend, adapter_root=str(tmp_path / "a_file"))


def test_nucleus_sampling_warns_once_that_the_ratio_reads_below_one(server, backend, caplog):
    engine = engine_on(server, backend)
    prompts = encode(backend, PROMPTS)
    with caplog.at_level(logging.WARNING, logger="retrain"):
        for _ in range(2):
            engine.generate(prompts, 2, SamplingParams(max_tokens=4, temperature=1.0, top_p=0.9), generator_seed=1)
    warnings = [r.getMessage() for r in caplog.records if "renormalised nucleus" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith("training.top_p=0.9: SGLang reports log-probs"), warnings
    engine.close()
