"""Server replies are checked like a plugin's outputs (retrain/inference/replies.py): a malformed reply or an
impossible value ends the run with one line naming the engine, the url and the field, never a traceback and
never a step trained on it. Each engine talks to a loopback server that answers as its real one does,
except for the one field a test breaks."""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch

from retrain.inference.config import OpenAIEngineConfig, SglangEngineConfig, VllmServerEngineConfig
from retrain.inference.openai_server import OpenAIEngine
from retrain.inference.replies import ServerReplyError
from retrain.inference.sglang import SglangEngine
from retrain.inference.vllm_server import VllmServerEngine
from retrain.model.resources import EngineResources
from retrain.model.spec import ModelSpec
from retrain.types import SamplingParams
from tests.backend.tiny_model import tokenizer_of
from tests.inference.loopback import ok, serve

CONFIGS: dict[type, type] = {
    VllmServerEngine: VllmServerEngineConfig,
    SglangEngine: SglangEngineConfig,
    OpenAIEngine: OpenAIEngineConfig,
}

SPEC = ModelSpec(name_or_path="retrain:tiny_qwen3", lora_rank=4)
SAMPLING = SamplingParams(max_tokens=4, temperature=1.0, top_p=1.0)
TOKENS, LOGPROBS = [5, 6, 7], [-0.5, -1.25, -2.0]  # a valid completion: 3 tokens of at most 4
Tamper = Callable[[Any], Any]


def unchanged(reply: Any) -> Any:
    return reply


def vllm_routes(tamper: Tamper) -> dict:
    """vLLM's OpenAI-compatible server: /v1/models, the LoRA routes, /v1/completions (with the top-2
    log-probs of the start-up log-prob mode check); `tamper` rewrites each sampling reply."""

    def completions(body: dict) -> Any:
        if body.get("logprobs") == 2:  # the log-prob mode check: processed log-probs
            top = {f"token_id:{i}": value / body["temperature"] for i, value in enumerate((-0.2, -1.9))}
            return ok({"choices": [{"index": 0, "token_ids": [0], "logprobs": {"top_logprobs": [top]}}]})
        choice = {"token_ids": TOKENS, "logprobs": {"token_logprobs": LOGPROBS}, "finish_reason": "length"}
        reply = {"choices": [{"index": g, **copy.deepcopy(choice)} for g in range(body["n"])]}
        return ok(tamper(reply))

    return {
        "GET /v1/models": lambda body: ok({"data": [{"id": "base", "parent": None}]}),
        "POST /v1/load_lora_adapter": lambda body: ok("Success"),
        "POST /v1/unload_lora_adapter": lambda body: ok("Success"),
        "POST /v1/completions": completions,
    }


def sglang_routes(tamper: Tamper) -> dict:
    """SGLang's native API: /health, the LoRA routes, a batched /generate; `tamper` rewrites each reply."""

    def generate(body: dict) -> Any:
        meta = {
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(LOGPROBS, TOKENS)],
            "finish_reason": {"type": "length", "length": 3},
        }
        return ok(tamper([{"text": "", "meta_info": copy.deepcopy(meta)} for _ in body["input_ids"]]))

    return {
        "GET /health": lambda body: ok(""),
        "POST /load_lora_adapter": lambda body: ok({"success": True}),
        "POST /unload_lora_adapter": lambda body: ok({"success": True}),
        "POST /generate": generate,
    }


def openai_routes(tamper: Tamper) -> dict:
    """An OpenAI-compatible server with token prompts, token ids and n, without a LoRA route."""

    def completions(body: dict) -> Any:
        count = len(TOKENS) if body["max_tokens"] > 1 else 1
        choice = {
            "token_ids": TOKENS[:count],
            "logprobs": {"tokens": ["a"] * count, "token_logprobs": LOGPROBS[:count]},
            "finish_reason": "length",
        }
        reply = {"choices": [{"index": g, **copy.deepcopy(choice)} for g in range(body.get("n", 1))]}
        return ok(tamper(reply) if body["max_tokens"] > 1 else reply)

    return {"GET /v1/models": lambda body: ok({"data": [{"id": "m"}]}), "POST /v1/completions": completions}


ENGINES = {
    "vllm_server": (VllmServerEngine, vllm_routes),
    "sglang": (SglangEngine, sglang_routes),
    "openai": (OpenAIEngine, openai_routes),
}


@pytest.fixture(scope="module")
def tokenizer():
    return tokenizer_of(SPEC.name_or_path)


def generate_with(engine_name: str, tamper: Tamper, tokenizer: Any):
    engine_cls, routes = ENGINES[engine_name]
    with serve(routes(tamper)) as server:
        engine = engine_cls(
            CONFIGS[engine_cls](url=server.url), tokenizer, EngineResources(spec=SPEC, device=torch.device("cpu"))
        )
        try:
            return engine.generate([[1, 2, 3], [4, 5]], 2, SAMPLING, generator_seed=0), server.url
        finally:
            engine.close()


def refused(engine_name: str, tamper: Tamper, tokenizer: Any) -> str:
    """The one-line error the engine ends with, checked to name the engine and the server."""
    with pytest.raises(ServerReplyError) as caught:
        generate_with(engine_name, tamper, tokenizer)
    message = str(caught.value)
    assert message.startswith(f"inference={engine_name}: http://127.0.0.1:") and "\n" not in message
    return message


def first_choice(edit: Callable[[dict], None]) -> Tamper:
    def tamper(reply: dict) -> dict:
        edit(reply["choices"][0])
        return reply

    return tamper


def first_meta(edit: Callable[[dict], None]) -> Tamper:
    def tamper(reply: list) -> list:
        edit(reply[0]["meta_info"])
        return reply

    return tamper


def set_logprobs(values: list[Any]) -> Tamper:
    return first_choice(lambda choice: choice["logprobs"].update(token_logprobs=values))


def set_tokens(values: list[Any]) -> Tamper:
    return first_choice(lambda choice: choice.update(token_ids=values))


@pytest.mark.parametrize("engine_name", sorted(ENGINES))
def test_a_well_formed_reply_passes(engine_name, tokenizer):
    rollouts, _ = generate_with(engine_name, unchanged, tokenizer)
    assert rollouts.completion_ids[0, :3].tolist() == TOKENS
    assert rollouts.logprobs[0, :3].tolist() == LOGPROBS


MALFORMED = [
    ("vllm_server", lambda reply: {**reply, "choices": None}, r"null at `choices`"),
    ("vllm_server", lambda reply: {"object": "text_completion"}, r"no value at `choices`"),
    ("vllm_server", first_choice(lambda choice: choice.pop("index")), r"no value at `choices\[0\]\.index`"),
    ("vllm_server", set_logprobs([None, -1.0, -1.0]), r"null .* where a log-prob .* at `choices\[0\]\.logprobs"),
    ("vllm_server", set_logprobs(["-0.5", -1.0, -1.0]), r"text '-0.5' where a log-prob"),
    ("vllm_server", set_logprobs([-0.5, -1.0]), r"2 log-probs for 3 tokens .* at `choices\[0\]`"),
    ("vllm_server", set_tokens([-1, 6, 7]), r"token id -1, outside the vocabulary"),
    ("vllm_server", set_tokens([5.0, 6, 7]), r"number 5.0 where an integer belongs at `choices\[0\]\.token_ids\[0\]`"),
    ("vllm_server", lambda reply: "<html><body>502 Bad Gateway</body></html>", r"text '<html>.* JSON object"),
    ("vllm_server", lambda reply: '{"choices": [{"index": 0, "tok', r"""text '{"choices": .* JSON object"""),
    ("sglang", first_meta(lambda meta: meta.clear()), r"no value at `\[0\]\.meta_info\.output_token_logprobs`"),
    ("sglang", lambda reply: [{"text": ""} for _ in reply], r"no value at `\[0\]\.meta_info`"),
    ("sglang", first_meta(lambda meta: meta.update(finish_reason="length")), r"text 'length'.*finish_reason"),
    ("sglang", lambda reply: {"error": "oops"}, r"object .* where an array belongs at `\(the reply\)`"),
    ("openai", lambda reply: {**reply, "choices": None}, r"null at `choices`"),
    ("openai", set_logprobs(None), r"null at `choices\[0\]\.logprobs\.token_logprobs`"),
]


@pytest.mark.parametrize(("engine_name", "tamper", "expected"), MALFORMED)
def test_a_malformed_reply_ends_with_one_line_naming_engine_and_field(engine_name, tamper, expected, tokenizer):
    assert re.search(expected, refused(engine_name, tamper, tokenizer))


def sglang_logprob(value: float) -> Tamper:
    return first_meta(lambda meta: meta["output_token_logprobs"][1].__setitem__(0, value))


IMPOSSIBLE = [
    (
        "vllm_server",
        set_logprobs([-0.5, 5.4, -1.0]),
        r"log-prob 5.4 > 0 \(a probability above 1\) at `choices\[0\] token 1`",
    ),
    ("sglang", sglang_logprob(0.3), r"log-prob 0.3 > 0 .* at `\[0\] token 1`"),
    ("openai", set_logprobs([-0.5, 2.0, -1.0]), r"log-prob 2 > 0"),
    ("vllm_server", set_tokens([5] * 2812), r"2812 tokens where max_tokens is 4"),
    (
        "sglang",
        first_meta(lambda meta: meta["output_token_logprobs"].extend([[-1.0, 9, None]] * 9)),
        r"12 tokens where",
    ),
    ("vllm_server", set_tokens([5, 10**7, 7]), r"token id 10000000, outside the vocabulary \[0, \d+\)"),
    ("openai", set_tokens([5, 6, 2**40]), r"outside the vocabulary"),
    ("vllm_server", set_logprobs([-0.5, math.nan, -1.0]), r"a NaN log-prob \(the server's numerics failed"),
    ("sglang", sglang_logprob(math.nan), r"a NaN log-prob \(the server's"),
    ("vllm_server", set_logprobs([-0.5, -math.inf, -1.0]), r"log-prob -inf for a token it sampled"),
    ("vllm_server", set_logprobs([-0.5, -1e308, -1.0]), r"log-prob -1e\+308 for a token it sampled"),
]


@pytest.mark.parametrize(("engine_name", "tamper", "expected"), IMPOSSIBLE)
def test_impossible_values_are_refused_never_trained_on(engine_name, tamper, expected, tokenizer):
    assert re.search(expected, refused(engine_name, tamper, tokenizer))


@pytest.mark.parametrize(
    ("engine_name", "models", "expected"),
    [
        ("vllm_server", "vllm ok", r"text 'vllm ok' where a JSON object belongs at `\(the reply\)`"),
        ("vllm_server", {"object": "list"}, r"no value at `data`"),
        ("openai", "gpt", r"text 'gpt' where a JSON object belongs"),
    ],
)
def test_an_unusable_model_list_ends_the_start_in_one_line(engine_name, models, expected, tokenizer):
    engine_cls, routes = ENGINES[engine_name]
    with (
        serve({**routes(unchanged), "GET /v1/models": lambda body: ok(models)}) as server,
        pytest.raises(ServerReplyError) as caught,
    ):
        engine_cls(
            CONFIGS[engine_cls](url=server.url), tokenizer, EngineResources(spec=SPEC, device=torch.device("cpu"))
        )
    message = str(caught.value)
    assert message.startswith(f"inference={engine_name}: {server.url}/v1/models answered") and "\n" not in message
    assert re.search(expected, message)
