"""The PRIME-RL engine against a loopback stand-in for the PRIME-RL inference server: a vLLM
OpenAI-compatible server (the tiny model answering /v1/completions) with PRIME-RL's admin routes
(/load_lora_adapter, /pause, /update_weights, /resume), recording every request; and the freshness
proof between that server and the backend's CPU copy of the broadcast weights."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from retrain.backend.prime_rl.engine import PrimeRlEngine
from retrain.model.probe import Probe, StaleWeightsError
from retrain.training.freshness import FreshnessProof
from retrain.types import SamplingParams, WeightUpdate
from tests.backend.prime_rl_helpers import SPEC, make_backend, train_batch, write_broadcast
from tests.backend.test_prime_rl_backend import fake_prime_rl_trainer
from tests.backend.tiny_model import PROMPTS, tokenizer_of
from tests.inference.fake_servers import ServedModel, openai_routes
from tests.inference.loopback import Answer, ok, serve

PAUSE = "/pause?mode=keep&clear_cache=false"


def prime_rl_server_routes(model: ServedModel, tokenizer: Any, fail_update: bool = False) -> dict:
    sampling = openai_routes(model, tokenizer, n=True, token_prompts=True, token_ids=True, lora=False)

    def completions(body: dict[str, Any]) -> Answer:
        adapter = None if body["model"] == "tiny" else body["model"]
        if body.get("prompt_logprobs") is not None:  # vLLM's prompt scoring: [None, {"<id>": {"logprob"}}...]
            scored = model.score(adapter, body["prompt"])
            entries = [None] + [{str(t): {"logprob": lp}} for t, lp in zip(body["prompt"][1:], scored[1:])]
            return ok({"choices": [{"index": 0, "token_ids": [0], "prompt_logprobs": entries}]})
        if body.get("logprobs") == 2:  # the engine's --logprobs-mode check: processed (tempered) log-probs
            logp = model.logprobs(adapter, body["prompt"], body["temperature"])[-1]
            top = {f"token_id:{int(i)}": float(logp[i]) for i in logp.topk(2).indices}
            return ok({"choices": [{"index": 0, "token_ids": [0], "logprobs": {"top_logprobs": [top]}}]})
        return sampling["POST /v1/completions"](body)

    def load_adapter(body: dict[str, Any]) -> Answer:  # PRIME-RL's wrapper: load_inplace, any name
        model.load(body["lora_name"], body["lora_path"])
        return ok({"status": "ok"})

    def unload_adapter(body: dict[str, Any]) -> Answer:
        model.adapters.pop(body["lora_name"])
        return ok("Success")

    return {
        "GET /v1/models": lambda body: ok({"data": [{"id": "tiny", "parent": None}]}),
        "POST /v1/completions": completions,
        "POST /load_lora_adapter": load_adapter,
        "POST /v1/unload_lora_adapter": unload_adapter,
        f"POST {PAUSE}": lambda body: ok({"status": "paused"}),
        "POST /update_weights": lambda body: (
            (400, {"detail": "bad weights"}, {}) if fail_update else ok({"status": "ok"})
        ),
        "POST /resume": lambda body: ok({"status": "resumed"}),
    }


@pytest.fixture
def tokenizer():
    return tokenizer_of(SPEC.name_or_path)


def test_the_engine_samples_and_follows_adapter_broadcasts(tmp_path, tokenizer):
    model = ServedModel()
    with serve(prime_rl_server_routes(model, tokenizer)) as server:
        engine = PrimeRlEngine(tokenizer, SPEC, server.url)
        prompts = [list(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in PROMPTS[:2]]
        rollouts = engine.generate(prompts, 2, SamplingParams(max_tokens=4), generator_seed=0)
        assert rollouts.num_rows == 4 and engine.weights_version == 0
        first, second = (write_broadcast(tmp_path / f"step_{n}", seed=n) for n in (1, 2))
        engine.sync(WeightUpdate(version=1, adapter_dir=first))
        engine.sync(WeightUpdate(version=2, adapter_dir=second))
        engine.generate(prompts[:1], 2, SamplingParams(max_tokens=2), generator_seed=1)
        with pytest.raises(StaleWeightsError, match="already serves version 2"):
            engine.sync(WeightUpdate(version=1, adapter_dir=first))
        engine.close()
    loads = [request.body for request in server.asked("/load_lora_adapter")]
    assert loads == [
        {"lora_name": "policy-v1", "lora_path": str(first)},
        {"lora_name": "policy-v2", "lora_path": str(second)},
    ]
    unloads = [request.body for request in server.asked("/v1/unload_lora_adapter")]
    assert unloads == [{"lora_name": "policy-v1"}, {"lora_name": "policy-v2"}]
    sampled_with = [r.body["model"] for r in server.asked("/v1/completions") if "n" in r.body]
    assert sampled_with[0] == "tiny" and sampled_with[-1] == "policy-v2"


@pytest.mark.parametrize("fail_update", [False, True])
def test_full_weight_broadcasts_pause_update_and_always_resume(tmp_path, tokenizer, fail_update):
    weights = tmp_path / "broadcasts" / "step_1"
    weights.mkdir(parents=True)  # no adapter_config.json: full HF weights
    with serve(prime_rl_server_routes(ServedModel(), tokenizer, fail_update)) as server:
        engine = PrimeRlEngine(tokenizer, SPEC, server.url)
        start = len(server.requests)
        if fail_update:
            with pytest.raises(Exception, match="bad weights"):
                engine.sync(WeightUpdate(version=1, adapter_dir=weights))
        else:
            engine.sync(WeightUpdate(version=1, adapter_dir=weights))
            assert engine.weights_version == 1 and engine.reloads.served is None
        engine.close()
    admin = [(r.path, r.body) for r in server.requests[start:] if not r.path.startswith("/v1/")]
    assert admin == [(PAUSE, {}), ("/update_weights", {"weight_dir": str(weights)}), ("/resume", {})]


def test_the_freshness_proof_compares_the_server_with_the_broadcast(tmp_path, tokenizer):
    probe = Probe.from_tokenizer(tokenizer)
    backend = make_backend(tmp_path, sync_poll_s=0.02)
    proof = FreshnessProof(probe, backend)
    with serve(prime_rl_server_routes(ServedModel(), tokenizer)) as server:
        engine = PrimeRlEngine(tokenizer, SPEC, server.url)
        assert proof.check(engine, 0).gap < 1e-4  # both serve the base weights
        trainer = fake_prime_rl_trainer(tmp_path, steps=1, received=[])
        update = backend.train(train_batch()).update
        trainer.join()
        assert update is not None
        with pytest.raises(StaleWeightsError, match="weights version 1"):
            proof.check(engine, 1)  # the server was not told to reload
        engine.sync(update)
        fresh = FreshnessProof(probe, backend).check(engine, 1)
        assert fresh.gap < 1e-4
        assert torch.equal(backend.probe_logprobs(probe), backend.probe_logprobs(probe))
        engine.close()
    backend.close()
