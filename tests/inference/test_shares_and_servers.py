"""The server engines sample a data-parallel rank's share of a batch (`row_offset`) as the whole batch would, and
spread a step's groups round-robin over several servers (`inference.url` listing them), whose answers equal
one server's: loopback servers answering with the real tiny model (tests/inference/fake_servers.py)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from retrain.errors import ConfigError, UserError
from retrain.inference.config import OpenAIEngineConfig, SglangEngineConfig, server_urls
from retrain.inference.endpoint import EngineEndpoint
from retrain.inference.http import HttpError
from retrain.inference.openai_server import OpenAIEngine
from retrain.inference.reachable import check_server_answers
from retrain.inference.sglang import SglangEngine
from retrain.model.probe import Probe
from retrain.types import Rollouts, SamplingParams
from tests.backend.tiny_model import PROMPTS, encode, make_backend, tokenizer_of
from tests.inference.fake_servers import ServedModel, openai_routes, sglang_routes
from tests.inference.loopback import serve

GROUP = 2
SAMPLED = SamplingParams(max_tokens=6, temperature=1.0, top_p=1.0)
OPENAI_FULL = {"n": True, "token_prompts": True, "token_ids": True, "lora": True}
OPENAI_BARE = {"n": False, "token_prompts": True, "token_ids": False, "lora": False}


@pytest.fixture(scope="module")
def served_models():
    return ServedModel(), ServedModel()  # two servers, each with its own adapters


@pytest.fixture
def fresh_models(served_models):
    for model in served_models:
        model.adapters.clear()
    return served_models


@pytest.fixture
def backend(tiny_spec):
    return make_backend(tiny_spec)


def routes_of(kind: str, model: ServedModel, tokenizer) -> dict:
    if kind == "sglang":
        return sglang_routes(model)
    return openai_routes(model, tokenizer, **(OPENAI_FULL if kind == "openai" else OPENAI_BARE))


def engine_on(kind: str, url, backend):
    tokenizer, resources = tokenizer_of(backend.spec.name_or_path), backend.engine_resources()
    if kind == "sglang":
        return SglangEngine(SglangEngineConfig(url=url), tokenizer=tokenizer, resources=resources)
    return OpenAIEngine(OpenAIEngineConfig(url=url, api_key_env=""), tokenizer=tokenizer, resources=resources)


def rows(rollouts: Rollouts) -> list[tuple[list[int], list[float], bool]]:
    """Each row's completion tokens, log-probs and cut flag, unpadded (widths differ between calls)."""
    lengths = rollouts.completion_mask.sum(dim=1).tolist()
    return [
        (
            rollouts.completion_ids[row, :length].tolist(),
            rollouts.logprobs[row, :length].tolist(),
            bool(rollouts.hit_max_tokens[row]),
        )
        for row, length in enumerate(lengths)
    ]


def assert_same_rows(
    got: list[tuple[list[int], list[float], bool]], expected: list[tuple[list[int], list[float], bool]]
):
    """The same tokens and cuts, and log-probs equal to float noise (an engine batching other rows beside a
    row may round its logits otherwise)."""
    assert [(ids, cut) for ids, _, cut in got] == [(ids, cut) for ids, _, cut in expected]
    for (_, logprobs, _), (_, want, _) in zip(got, expected):
        assert logprobs == pytest.approx(want, abs=1e-5)


@pytest.mark.parametrize("kind", ["sglang", "openai", "openai_bare"])
def test_two_shares_with_their_row_offsets_sample_the_whole_batch(kind, fresh_models, backend):
    tokenizer = tokenizer_of(backend.spec.name_or_path)
    prompts = encode(backend, PROMPTS)
    with serve(routes_of(kind, fresh_models[0], tokenizer)) as server:
        engine = engine_on(kind, server.url, backend)
        try:
            whole = engine.generate(prompts, GROUP, SAMPLED, 7)
            head = engine.generate(prompts[:1], GROUP, SAMPLED, 7, row_offset=0)
            tail = engine.generate(prompts[1:], GROUP, SAMPLED, 7, row_offset=GROUP)
            unshifted = engine.generate(prompts[1:], GROUP, SAMPLED, 7)
        finally:
            engine.close()
    assert rows(head) + rows(tail) == rows(whole)
    assert rows(unshifted) != rows(tail)  # the offset is what makes the share's seeds the batch's
    with pytest.raises(ValueError, match="row_offset=1 is not the first row of a group of 2"):
        engine.generate(prompts, GROUP, SAMPLED, 7, row_offset=1)


@pytest.mark.parametrize("kind", ["sglang", "openai"])
def test_groups_go_round_robin_over_two_servers_and_sample_as_one_server(kind, fresh_models, backend):
    tokenizer = tokenizer_of(backend.spec.name_or_path)
    prompts = encode(backend, PROMPTS)
    route = "/generate" if kind == "sglang" else "/v1/completions"

    def sampled_prompts(server) -> list[list[int]]:
        """The prompts `server` was asked to sample (not the start-up checks' or the probe's requests), sorted: the
        requests of one call arrive in any order."""
        bodies = [request.body for request in server.asked(route)]
        if kind == "sglang":
            return sorted(body["input_ids"][0] for body in bodies if isinstance(body.get("sampling_params"), list))
        return sorted(body["prompt"] for body in bodies if body.get("max_tokens") == SAMPLED.max_tokens)

    with (
        serve(routes_of(kind, fresh_models[0], tokenizer)) as a,
        serve(routes_of(kind, fresh_models[1], tokenizer)) as b,
    ):
        one = engine_on(kind, a.url, backend)
        try:
            expected = one.generate(prompts, GROUP, SAMPLED, 3)
        finally:
            one.close()
        a.requests.clear()
        both = engine_on(kind, [a.url, b.url], backend)  # the YAML-list form of inference.url
        try:
            assert rows(both.generate(prompts, GROUP, SAMPLED, 3)) == rows(expected)
            assert sampled_prompts(a) == sorted(prompts[0::2]) and sampled_prompts(b) == sorted(prompts[1::2])
            for server in (a, b):
                server.requests.clear()
            # a share starting at group 1 (a second rank's): its first group goes to server b, as in the batch
            share = both.generate(prompts[1:3], GROUP, SAMPLED, 3, row_offset=GROUP)
            assert sampled_prompts(b) == [prompts[1]] and sampled_prompts(a) == [prompts[2]]
            assert rows(share) == rows(expected)[GROUP : 3 * GROUP]
            # the adapter went to both servers, and the freshness probe asks each in turn
            assert [set(model.adapters) for model in fresh_models] == [{"policy-v0"}, {"policy-v0"}]
            for server in (a, b):
                server.requests.clear()
            probes = [both.probe_logprobs(Probe.from_tokenizer(tokenizer)) for _ in range(2)]
            assert torch.allclose(probes[0], probes[1], atol=1e-5)
            assert len(a.asked(route)) == len(b.asked(route)) == 1
        finally:
            both.close()


def test_endpoint_requests_reach_the_servers_all_at_once_in_turn(fresh_models, backend):
    """An agent's requests through the loopback endpoint over a server engine: each is sent on its own thread at
    once (the servers batch them), they go to the servers in turn, and each samples what it samples alone."""
    prompt = encode(backend, PROMPTS[:1])[0]
    in_flight, most = [0], [0]
    lock = threading.Lock()

    def slowed(model: ServedModel) -> dict:
        routes = sglang_routes(model)
        generate = routes["POST /generate"]

        def slow_generate(body: dict) -> tuple:
            with lock:
                in_flight[0] += 1
                most[0] = max(most[0], in_flight[0])
            time.sleep(0.2)  # long enough for the other requests to arrive meanwhile
            try:
                return generate(body)
            finally:
                with lock:
                    in_flight[0] -= 1

        return {**routes, "POST /generate": slow_generate}

    with serve(slowed(fresh_models[0])) as a, serve(slowed(fresh_models[1])) as b:
        engine = engine_on("sglang", [a.url, b.url], backend)
        endpoint = EngineEndpoint(engine)
        try:
            for server in (a, b):
                server.requests.clear()
            most[0] = 0

            def ask(seed: int) -> list[int]:
                body = {"token_ids": prompt, "sampling_params": {"max_tokens": 4, "seed": seed}}
                answer = httpx.post(f"{endpoint.url.removesuffix('/v1')}/inference/v1/generate", json=body, timeout=30)
                return answer.json()["choices"][0]["token_ids"]

            with ThreadPoolExecutor(8) as pool:
                together = list(pool.map(ask, range(8)))
            assert most[0] >= 4 and endpoint.batcher.most_in_flight == 8
            assert len(a.asked("/generate")) == len(b.asked("/generate")) == 4
            alone = [engine.generate([prompt], 1, SamplingParams(max_tokens=4), seed) for seed in range(8)]
            assert together == [rows(rollouts)[0][0] for rollouts in alone]
        finally:
            endpoint.close()
            engine.close()


def test_server_urls_takes_a_list_or_commas_and_names_the_key_for_a_wrong_one():
    assert server_urls("http://a:1") == ["http://a:1"]
    assert server_urls("http://a:1/, http://b:2") == ["http://a:1", "http://b:2"]
    assert server_urls(["http://a:1", "https://b:2/"]) == ["http://a:1", "https://b:2"]
    for wrong, message in [
        ("", "inference.url is empty"),
        ("http://a:1,", "inference.url is empty"),
        ("http://a:1,b:2", "inference.url='b:2' is not an http"),
        (["http://a:1", 3], "inference.url: 3 is not a url"),
        ([], r"inference.url=\[\] is neither"),
        ("http://a:1,http://a:1/", "inference.url names http://a:1 more than once"),
    ]:
        with pytest.raises(ConfigError, match=message):
            server_urls(wrong)
    with pytest.raises(ConfigError, match="inference.url='ftp://x' is not an http"):
        SglangEngineConfig(url=["http://a:1", "ftp://x"])


def test_a_failing_server_fails_the_step_naming_its_url(fresh_models, backend):
    refusing = {**sglang_routes(fresh_models[1]), "POST /generate": lambda body: (400, {"error": "no"}, {})}
    with serve(sglang_routes(fresh_models[0])) as a, serve(refusing) as b:
        engine = engine_on("sglang", f"{a.url},{b.url}", backend)  # the comma-separated form
        try:
            with pytest.raises(HttpError, match=f"POST {b.url}/generate"):
                engine.generate(encode(backend, PROMPTS), GROUP, SAMPLED, 3)
        finally:
            engine.close()


def test_the_reachability_ping_asks_every_server(fresh_models):
    with serve(sglang_routes(fresh_models[0])) as a:
        check_server_answers({"url": [a.url], "max_retries": 0})
        with pytest.raises(UserError, match="inference.url: no server answers"):
            check_server_answers({"url": f"{a.url},http://127.0.0.1:9", "max_retries": 0})


def test_ranks_sharing_servers_load_their_own_adapter_names(fresh_models, backend, monkeypatch, tmp_path):
    """On rank 1 of 2, versions are served (and written under adapter_root) as policy-v{N}-r1."""
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 1)
    tokenizer, resources = tokenizer_of(backend.spec.name_or_path), backend.engine_resources()
    with serve(sglang_routes(fresh_models[0])) as server:
        config = SglangEngineConfig(url=server.url, adapter_root=str(tmp_path))
        engine = SglangEngine(config, tokenizer=tokenizer, resources=resources)
        try:
            assert set(fresh_models[0].adapters) == {"policy-v0-r1"} and (tmp_path / "policy-v0-r1").is_dir()
            engine.generate(encode(backend, PROMPTS[:1]), GROUP, SAMPLED, 3, row_offset=GROUP)
            assert all(body["lora_path"] == ["policy-v0-r1"] * GROUP for body in sampled_bodies(server))
        finally:
            engine.close()


def sampled_bodies(server) -> list[dict]:
    return [r.body for r in server.asked("/generate") if isinstance(r.body.get("sampling_params"), list)]
