"""inference=vllm_server finds out at start whether the server's log-probs follow the temperature
(`--logprobs-mode processed_logprobs`), against a loopback server answering as vLLM does in each mode."""

from __future__ import annotations

import pytest

from retrain.errors import ConfigError
from retrain.inference.config import VllmServerEngineConfig
from retrain.inference.vllm_server import VllmServerEngine
from retrain.types import SamplingParams
from tests.backend.tiny_model import make_backend, tokenizer_of
from tests.inference.loopback import ok, serve

RAW_TOP_TWO = (-0.2, -1.9)  # log-probs of the two likeliest tokens at T = 1


def vllm_routes(tempered: bool):
    """/v1/models, the LoRA routes, and /v1/completions answering the top-2 log-probs of one token."""

    def completions(body):
        scale = 1 / body["temperature"] if tempered else 1.0
        top = {f"token_id:{i}": value * scale for i, value in enumerate(RAW_TOP_TWO)}
        return ok({"choices": [{"index": 0, "token_ids": [0], "logprobs": {"top_logprobs": [top]}}]})

    return {
        "GET /v1/models": lambda body: ok({"data": [{"id": "base", "parent": None}]}),
        "POST /v1/load_lora_adapter": lambda body: ok("Success"),
        "POST /v1/unload_lora_adapter": lambda body: ok("Success"),
        "POST /v1/completions": completions,
    }


@pytest.mark.parametrize("tempered", [True, False])
def test_the_servers_logprob_mode_is_detected(tiny_spec, tempered):
    backend = make_backend(tiny_spec)
    with serve(vllm_routes(tempered)) as server:
        engine = VllmServerEngine(
            VllmServerEngineConfig(url=server.url),
            tokenizer=tokenizer_of(tiny_spec.name_or_path),
            resources=backend.engine_resources(),
        )
        assert engine.tempered_logprobs == tempered and engine.adapters.served == "policy-v0"
        if not tempered:
            with pytest.raises(ConfigError, match="raw logits.*--logprobs-mode processed_logprobs"):
                engine.generate([[1, 2, 3]], 2, SamplingParams(max_tokens=4, temperature=0.7), 0)
        engine.close()
