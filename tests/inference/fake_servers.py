"""Inference servers on loopback for the engine tests: SGLang's native API and OpenAI-compatible ones,
answering with a real model (the tiny Qwen3 and the LoRA adapters the engine loads), so what they
return can be checked against the trainer's own log-probs.

They stand for the remote services (the external boundary): the routes and fields follow SGLang's
documented `/generate`, `/load_lora_adapter`, `/unload_lora_adapter`, `/health`, and OpenAI's
`/v1/completions` with the variants servers differ in (n, token prompts, token ids, LoRA routes).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
from peft.utils import load_peft_weights
from transformers import AutoModelForCausalLM

from retrain.assets import TINY_MODEL_DIR
from retrain.model.logprobs import completion_logprobs
from retrain.types import WeightUpdate
from tests.inference.loopback import Answer, Route, ok


@dataclass
class Sampled:
    token_ids: list[int]
    logprobs: list[float]
    stopped: bool  # on a stop token (else: max tokens)


class ServedModel:
    """The tiny Qwen3 with LoRA adapters loaded by name: sampled with a KV cache, scored without one."""

    def __init__(self) -> None:
        self.base = AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR, dtype=torch.float32).eval()
        self.model: Any = None  # the PEFT wrapper, made at the first adapter load (its config comes with it)
        self.adapters: dict[str, dict[str, torch.Tensor]] = {}  # what the server has loaded, by name
        self.lock = threading.Lock()

    def load(self, name: str, path: str) -> None:
        """Each name is an adapter of its own in the PEFT wrapper: a forward switches between them (ranks and
        versions interleave token by token) instead of copying weights in."""
        self._add(name, LoraConfig.from_pretrained(path), load_peft_weights(path))

    def alias(self, name: str, source: str) -> None:
        """`source`'s weights under a second name as well (what a server serving stale weights would do)."""
        if name not in self.adapters:
            self._add(name, self.model.peft_config[source], self.adapters[source])

    def _add(self, name: str, config: LoraConfig, weights: dict[str, torch.Tensor]) -> None:
        with self.lock:
            if self.model is None:
                self.model = get_peft_model(self.base, config, adapter_name=name).eval()
            elif name not in self.model.peft_config:  # else unloaded and loaded again, maybe with other weights
                self.model.add_adapter(name, config)
            set_peft_model_state_dict(self.model, weights, adapter_name=name)
            self.adapters[name] = weights

    def _forward(self, adapter: str | None, tokens: list[int], cache: Any = None) -> tuple[torch.Tensor, Any]:
        """Logits of `tokens` (after the cached prefix, if any) and the cache that now holds them."""
        with self.lock, torch.no_grad():
            if adapter is None and self.model is None:
                output = self.base(input_ids=torch.tensor([tokens]), past_key_values=cache, use_cache=True)
            elif adapter is None:
                with self.model.disable_adapter():
                    output = self.model(input_ids=torch.tensor([tokens]), past_key_values=cache, use_cache=True)
            else:
                if self.model.active_adapter != adapter:
                    self.model.set_adapter(adapter)
                output = self.model(input_ids=torch.tensor([tokens]), past_key_values=cache, use_cache=True)
        return output.logits[0], output.past_key_values

    def logprobs(self, adapter: str | None, tokens: list[int], temperature: float = 1.0) -> torch.Tensor:
        """[len(tokens), V] log_softmax(logits / T) after each prefix (T = 0: T = 1)."""
        logits, _ = self._forward(adapter, tokens)
        return torch.log_softmax(logits.float() / (temperature or 1.0), dim=-1)

    def sample(
        self,
        adapter: str | None,
        prompt: list[int],
        max_tokens: int,
        temperature: float,
        top_p: float,
        seed: int | None,
        stop_ids: list[int],
    ) -> Sampled:
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        tokens, logprobs, cache = list(prompt), [], None
        for _ in range(max_tokens):
            logits, cache = self._forward(adapter, tokens if cache is None else tokens[-1:], cache)
            logp = torch.log_softmax(logits[-1].float() / (temperature or 1.0), dim=-1)
            if temperature == 0:
                token = int(logp.argmax())
            else:
                sorted_logp, order = logp.sort(descending=True)
                probs = sorted_logp.exp()
                nucleus = probs * ((probs.cumsum(0) - probs) < top_p)
                token = int(order[torch.multinomial(nucleus, 1, generator=generator)])
                logp = torch.log(nucleus / nucleus.sum())[order.argsort()]  # renormalized, as servers report
            tokens.append(token)
            logprobs.append(float(logp[token]))
            if token in stop_ids:
                return Sampled(tokens[len(prompt) :], logprobs, stopped=True)
        return Sampled(tokens[len(prompt) :], logprobs, stopped=False)

    def score(self, adapter: str | None, tokens: list[int]) -> list[float | None]:
        """Each token's log-prob given the tokens before it (None for the first), at T = 1."""
        logp = self.logprobs(adapter, tokens)
        return [None] + [float(logp[i - 1, tokens[i]]) for i in range(1, len(tokens))]


def _lora_routes(model: ServedModel, prefix: str) -> dict[str, Route]:
    """Runtime LoRA loading as SGLang (prefix "") and vLLM (prefix "/v1") expose it."""

    def load(body: dict[str, Any]) -> Answer:
        name, path = body.get("lora_name"), body.get("lora_path")
        if not name or not path:
            return 400, {"success": False, "error_message": "lora_name and lora_path are required"}, {}
        if name in model.adapters:
            return 400, {"success": False, "error_message": f"The LoRA adapter {name} is already loaded"}, {}
        if not (Path(path) / "adapter_config.json").is_file():
            return 400, {"success": False, "error_message": f"No adapter found for {path}"}, {}
        model.load(name, path)
        return ok({"success": True, "error_message": "", "loaded_adapters": sorted(model.adapters)})

    def unload(body: dict[str, Any]) -> Answer:
        if model.adapters.pop(body.get("lora_name"), None) is None:
            return 400, {"success": False, "error_message": f"{body.get('lora_name')} is not loaded"}, {}
        return ok({"success": True, "error_message": "", "loaded_adapters": sorted(model.adapters)})

    return {f"POST {prefix}/load_lora_adapter": load, f"POST {prefix}/unload_lora_adapter": unload}


def sglang_routes(model: ServedModel, lora: bool = True) -> dict[str, Route]:
    """SGLang's native API: /health, /generate (single or batched), and its LoRA routes."""

    def generate(body: dict[str, Any]) -> Answer:
        batched = bool(body["input_ids"]) and isinstance(body["input_ids"][0], list)
        inputs = body["input_ids"] if batched else [body["input_ids"]]
        count = len(inputs)
        params = body.get("sampling_params") or {}
        params = params if isinstance(params, list) else [params] * count
        adapters = body.get("lora_path")
        adapters = adapters if isinstance(adapters, list) else [adapters] * count
        if any(name is not None and name not in model.adapters for name in adapters):
            return 400, {"error": {"message": f"unknown LoRA adapter in {adapters}"}}, {}
        answers = []
        for prompt, param, adapter in zip(inputs, params, adapters):
            sampled = model.sample(
                adapter,
                prompt,
                param.get("max_new_tokens", 128),
                param.get("temperature", 1.0),
                param.get("top_p", 1.0),
                param.get("sampling_seed"),
                list(param.get("stop_token_ids") or []),
            )
            finish = (
                {"type": "stop", "matched": sampled.token_ids[-1]}
                if sampled.stopped
                else {"type": "length", "length": len(sampled.token_ids)}
            )
            meta: dict[str, Any] = {"finish_reason": finish, "completion_tokens": len(sampled.token_ids)}
            if body.get("return_logprob"):
                meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(sampled.logprobs, sampled.token_ids)]
                if body.get("logprob_start_len") is not None:
                    start = body["logprob_start_len"]
                    scored = model.score(adapter, prompt)[start:]
                    meta["input_token_logprobs"] = [[lp, t, None] for lp, t in zip(scored, prompt[start:])]
            answers.append({"text": "", "output_ids": sampled.token_ids, "meta_info": meta})
        return ok(answers if batched else answers[0])

    routes: dict[str, Route] = {"GET /health": lambda body: ok(""), "POST /generate": generate}
    return {**routes, **_lora_routes(model, "")} if lora else routes


def openai_routes(
    model: ServedModel,
    tokenizer: Any,
    *,
    n: bool,
    token_prompts: bool,
    token_ids: bool,
    lora: bool,
    name: str = "tiny",
) -> dict[str, Route]:
    """An OpenAI-compatible `/v1/completions` server, with or without n, token-id prompts,
    `return_token_ids` and vLLM's runtime-LoRA routes. Without token ids it answers the tokens as
    text (logprobs.tokens), as OpenAI's API does; `echo` returns the prompt's log-probs first."""

    def completions(body: dict[str, Any]) -> Answer:
        prompt = body["prompt"]
        if isinstance(prompt, list):
            if not token_prompts:
                return 400, {"error": {"message": "prompt must be a string"}}, {}
        else:
            prompt = list(tokenizer.encode(prompt, add_special_tokens=False))
        adapter = None if body["model"] == name else body["model"]
        if adapter is not None and adapter not in model.adapters:
            return 404, {"error": {"message": f"The model `{adapter}` does not exist."}}, {}
        choices = []
        for index in range(body.get("n", 1) if n else 1):
            seed = body.get("seed")
            sampled = model.sample(
                adapter,
                prompt,
                body.get("max_tokens", 16),
                body.get("temperature", 1.0),
                body.get("top_p", 1.0),
                None if seed is None else seed + index,
                [*(body.get("stop_token_ids") or []), tokenizer.eos_token_id],
            )
            ids, logprobs = sampled.token_ids, sampled.logprobs
            if body.get("echo"):
                ids, logprobs = prompt + ids, model.score(adapter, prompt) + logprobs
            choice: dict[str, Any] = {
                "index": index,
                "text": tokenizer.decode(sampled.token_ids),
                "finish_reason": "stop" if sampled.stopped else "length",
                "logprobs": {"tokens": [tokenizer.decode([t]) for t in ids], "token_logprobs": logprobs},
            }
            if token_ids and body.get("return_token_ids"):
                choice["token_ids"] = sampled.token_ids
            choices.append(choice)
        return ok({"object": "text_completion", "model": body["model"], "choices": choices})

    routes: dict[str, Route] = {
        "GET /v1/models": lambda body: ok({"object": "list", "data": [{"id": name, "object": "model"}]}),
        "POST /v1/completions": completions,
    }
    return {**routes, **_lora_routes(model, "/v1")} if lora else routes


# ---- what the tests compare a server's answers with -----------------------------------------
def trainer_logprobs(backend, rollouts) -> torch.Tensor:
    """[N, T] the trainer's log-probs of the rollouts' completions, each under its row's prompt (group-major)."""
    rows = torch.arange(rollouts.num_rows)
    with torch.no_grad():
        return completion_logprobs(
            backend.model,
            rollouts.prompt_ids,
            rollouts.prompt_mask,
            rows // rollouts.group_size,
            rollouts.completion_ids,
            rollouts.completion_mask,
            rollouts.temperature,
        )


def moved(backend, seed: int = 0) -> WeightUpdate:
    """Change the backend's adapter (as an optimizer step would) and return it as weights version 1."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in backend.adapter.items():
            if "lora_B" in name:
                parameter.copy_(0.05 * torch.randn(parameter.shape, generator=generator))
    return WeightUpdate(version=1, tensors=backend.adapter)
