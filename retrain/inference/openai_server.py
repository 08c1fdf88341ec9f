"""inference=openai: sampling on any OpenAI-compatible `/v1/completions` server (MAX, MLX-LM, TRT-LLM, ...).

Such servers differ in what they take beyond the OpenAI fields, so the engine asks at start:
- token prompts: a token-id `prompt` is tried first; a server that refuses it gets the prompt
  decoded to text, which it tokenizes again (it may split it differently from the trainer);
- token ids: `return_token_ids` (choices[i].token_ids) when the server answers them, else the ids
  of the returned token strings (`logprobs.tokens`: ints, "token_id:N", or text re-encoded with the
  tokenizer; a text that re-encodes to several ids carries its log-prob on the first and 0 on the
  others, one that re-encodes to none is dropped with its log-prob);
- `n`: when a request with n = 2 gets one completion (or is refused), each prompt's G completions
  are G requests with seed + g;
- a runtime-LoRA route (`/v1/load_lora_adapter`, as vLLM's): with one, each step's adapter is
  loaded as `policy-v{N}` (retrain.inference.served_adapters). Without one the server serves
  frozen weights: fine for evaluation, but the first sync raises StaleWeightsError naming the url.
Only OpenAI's sampling fields (temperature, top_p, max_tokens, seed, logprobs) plus the
extensions above are sent: the server's own defaults for anything else (top_k, penalties) apply,
and its log-probs follow its own semantics. docs/inference-engines.md lists what this loses.
Every reply is read and checked through retrain.inference.replies.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from retrain.errors import ConfigError
from retrain.inference.base import NucleusLogprobsWarning
from retrain.inference.completions import Completion, first_prompt, request_seed, rollouts_from_completions
from retrain.inference.config import OpenAIEngineConfig
from retrain.inference.finish_reason import hit_max_tokens
from retrain.inference.http import HttpClient, HttpError
from retrain.inference.replies import ReplyLimits, ServerRoute
from retrain.inference.served_adapters import LoraRoutes, ServedAdapters
from retrain.inference.server_engine import Server, ServerEngine
from retrain.model.probe import Probe, StaleWeightsError
from retrain.model.resources import EngineResources
from retrain.plugins import built_in
from retrain.settings_object import takes_settings
from retrain.types import Rollouts, SamplingParams, WeightUpdate

log = logging.getLogger(__name__)

COMPLETIONS = "/v1/completions"
TOKEN_ID_PREFIX = "token_id:"  # how vLLM spells a token with return_tokens_as_token_ids
OPENAI_LORA_ROUTES = LoraRoutes(
    load="/v1/load_lora_adapter",
    unload="/v1/unload_lora_adapter",
    server="the server",
    requirements="its runtime-LoRA routes enabled",
)


@dataclass(frozen=True)
class ServerFeatures:
    """What an OpenAI-compatible server turned out to support at start."""

    token_prompts: bool  # takes a list of token ids as `prompt`
    token_ids: bool  # answers choices[i].token_ids when asked with return_token_ids
    n: bool  # answers n completions to one request
    lora_routes: bool  # has /v1/load_lora_adapter


@built_in
@takes_settings(OpenAIEngineConfig)
class OpenAIEngine(ServerEngine):
    """Samples on an OpenAI-compatible server; see the module docstring."""

    returns_entropies = False

    def __init__(self, config: OpenAIEngineConfig, tokenizer: Any, resources: EngineResources) -> None:
        super().__init__(config, tokenizer, resources, "openai", COMPLETIONS)
        self.nucleus_warning = NucleusLogprobsWarning("the server")
        self.fault_skip_weight_sync = config.fault_skip_weight_sync
        with self.closed_on_failure():
            self.model = config.model or self._first_model()
            prompt = Probe.from_tokenizer(tokenizer).prompt_ids
            features = {server.url: self._detect(server, prompt) for server in self.servers}
            if len(set(features.values())) > 1:
                raise ConfigError(
                    f"inference.url: the servers support different things ({features}); list servers of one kind"
                )
            self.features = next(iter(features.values()))
            log.info("OpenAI-compatible server at %s (model %s): %s", self.url, self.model, self.features)
            self.adapters = (
                ServedAdapters(
                    self.clients, OPENAI_LORA_ROUTES, resources, config.adapter_root, config.fault_skip_weight_sync
                )
                if self.features.lora_routes
                else None
            )

    @property
    def weights_version(self) -> int:
        return 0 if self.adapters is None else self.adapters.version

    def generate(
        self,
        prompt_ids: list[list[int]],
        group_size: int,
        sampling: SamplingParams,
        generator_seed: int | None,
        row_offset: int = 0,
    ) -> Rollouts:
        first = first_prompt(row_offset, group_size)  # prompt i is the batch's first + i (a rank's share)
        self.nucleus_warning.check(sampling)
        together = self.features.n and sampling.temperature > 0  # greedy requests take n = 1 on most servers
        groups = []
        for index, prompt in enumerate(prompt_ids):
            seed = request_seed(generator_seed, first + index)
            if together:
                groups.append([self._body(prompt, sampling, group_size, seed)])
            else:
                groups.append(
                    [self._body(prompt, sampling, 1, None if seed is None else seed + g) for g in range(group_size)]
                )
        per_answer = group_size if together else 1
        limits = ReplyLimits(sampling.max_tokens, self.vocab_size)
        completions = [
            c
            for route, answers in self.post_groups(COMPLETIONS, groups, first)
            for answer in answers
            for c in self._completions(answer, per_answer, limits, route)
        ]
        return rollouts_from_completions(prompt_ids, completions, group_size, sampling, self.tokenizer)

    def sync(self, update: WeightUpdate) -> None:
        if self.adapters is not None:
            self.adapters.sync(update)
        elif self.fault_skip_weight_sync:
            log.warning("inference.fault_skip_weight_sync=true (a test hook): version %d is NOT pushed", update.version)
        else:
            raise StaleWeightsError(
                f"inference=openai: the server at {self.url} has no runtime-LoRA route, so it serves frozen "
                f"weights and cannot follow training (asked for weights version {update.version}); use it for "
                "evaluation only, or sample with inference=vllm_server or inference=sglang"
            )

    def probe_logprobs(self, probe: Probe) -> torch.Tensor:
        """The continuation's log-probs echoed back (`echo` with `logprobs`) under the served weights."""
        if not self.features.token_prompts:
            raise StaleWeightsError(
                f"inference=openai: the server at {self.url} takes no token-id prompts, so the freshness probe "
                "cannot score the probe's exact tokens"
            )
        body = {
            "model": self._served_model(),
            "prompt": probe.prompt_ids + probe.completion_ids,
            "echo": True,
            "logprobs": 1,
            "max_tokens": 1,
            "temperature": 1.0,
            "top_p": 1.0,
        }
        server = self.next_probed()
        answer = server.client.post(COMPLETIONS, body)
        route = server.route
        with route.reading("freshness-probe reply"):
            choices = route.array(route.member(answer, "choices", ""), "choices")
            if not choices:
                route.fail("choices", "no choice")
            logprobs = route.member(choices[0], "logprobs", "choices[0]")
            scored = route.array(route.member(logprobs, "token_logprobs", "choices[0].logprobs"), "choices[0].logprobs")
            start = len(probe.prompt_ids)
            values = scored[start : start + len(probe.completion_ids)]
            if len(values) != len(probe.completion_ids) or any(value is None for value in values):
                route.fail(
                    "choices[0].logprobs.token_logprobs", f"echoed log-probs {scored} that miss the probe's tokens"
                )
            return torch.tensor(route.logprobs(values, "choices[0].logprobs.token_logprobs"), dtype=torch.float32)

    def close(self) -> None:
        try:
            if self.adapters is not None:
                self.adapters.close()
        finally:
            self.close_clients()

    # ---- requests ----------------------------------------------------------------------------
    def _served_model(self, sampling: bool = False) -> str:
        """The model a request names: the newest adapter, or for a sampling request the version its batch is pinned
        to (sampling ahead); the server's model without adapters."""
        if self.adapters is None:
            return self.model
        return (self.adapters.sampled_name() if sampling else self.adapters.served) or self.model

    def _body(self, prompt: list[int], sampling: SamplingParams, n: int, seed: int | None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self._served_model(sampling=True),
            "prompt": prompt if self.features.token_prompts else self.tokenizer.decode(prompt),
            "n": n,
            "max_tokens": sampling.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "logprobs": 1,
        }
        if seed is not None:
            body["seed"] = seed
        if self.features.token_ids:
            body.update(return_token_ids=True, stop_token_ids=self.stop_ids)
        return body

    def _completions(self, answer: Any, n: int, limits: ReplyLimits, route: ServerRoute) -> list[Completion]:
        """The completions of one answer, in order (checked: replies.py)."""
        with route.reading("completion"):
            choices = route.array(route.member(answer, "choices", ""), "choices")
            if len(choices) != n:
                route.fail("choices", f"{len(choices)} completions, expected {n}")
            for i, choice in enumerate(choices):
                route.integer(route.mapping(choice, f"choices[{i}]").get("index", 0), f"choices[{i}].index")
            choices = sorted(choices, key=lambda choice: choice.get("index", 0))
            completions = []
            for i, choice in enumerate(choices):
                field = f"choices[{i}]"
                logprobs = route.member(choice, "logprobs", field)
                values = route.logprobs(
                    route.member(logprobs, "token_logprobs", f"{field}.logprobs"), f"{field}.logprobs.token_logprobs"
                )
                if self.features.token_ids and choice.get("token_ids") is not None:
                    token_ids = route.token_ids(choice["token_ids"], f"{field}.token_ids")
                    token_logprobs = values
                else:
                    tokens = route.array(logprobs.get("tokens") or [], f"{field}.logprobs.tokens")
                    if len(tokens) > limits.max_tokens:
                        route.fail(
                            f"{field}.logprobs.tokens", f"{len(tokens)} tokens where max_tokens is {limits.max_tokens}"
                        )
                    if len(tokens) != len(values):
                        route.fail(field, f"{len(values)} log-probs for {len(tokens)} tokens (one per token is needed)")
                    token_ids, token_logprobs = self._retokenized(tokens, values, f"{field}.logprobs.tokens", route)
                    limits = ReplyLimits(max(limits.max_tokens, len(token_ids)), limits.vocab_size)  # re-encoded text
                completions.append(
                    route.completion(
                        token_ids,
                        token_logprobs,
                        hit_max_tokens(route.url, choice.get("finish_reason")),
                        limits,
                        field,
                    )
                )
            return completions

    def _retokenized(
        self, tokens: list[Any], values: list[float], field: str, route: ServerRoute
    ) -> tuple[list[int], list[float]]:
        """Token ids of the returned token strings, each log-prob on its token's first id (module docstring)."""
        ids: list[int] = []
        logprobs: list[float] = []
        for i, (token, value) in enumerate(zip(tokens, values)):
            if isinstance(token, int) and not isinstance(token, bool):
                pieces = [token]
            elif isinstance(token, str) and token.startswith(TOKEN_ID_PREFIX):
                pieces = [int(token[len(TOKEN_ID_PREFIX) :])]
            else:
                pieces = list(self.tokenizer.encode(route.text(token, f"{field}[{i}]"), add_special_tokens=False))
            ids.extend(pieces)
            logprobs.extend([value] + [0.0] * (len(pieces) - 1) if pieces else [])
        return ids, logprobs

    # ---- what the server supports ------------------------------------------------------------
    def _first_model(self) -> str:
        route = ServerRoute("openai", self.url + "/v1/models")
        models = route.array(route.member(self.client.get("/v1/models"), "data", ""), "data")
        if not models:
            raise ConfigError(f"inference.model is empty and {self.url}/v1/models lists no model: name one")
        return str(route.member(models[0], "id", "data[0]"))

    def _detect(self, server: Server, prompt: list[int]) -> ServerFeatures:
        """Ask a server, with tiny requests, what it supports (see the module docstring)."""
        base = {"model": self.model, "max_tokens": 1, "temperature": 1.0, "top_p": 1.0, "logprobs": 1}
        extensions = {"return_token_ids": True, "stop_token_ids": self.stop_ids}  # vLLM's
        attempts = [(prompt, extensions), (prompt, {}), (self.tokenizer.decode(prompt), {})]
        for text_or_ids, extra in attempts:
            try:
                answer = server.client.post(COMPLETIONS, {**base, "prompt": text_or_ids, **extra})
            except HttpError as error:
                if error.status not in (400, 422):
                    raise
                continue
            token_prompts = isinstance(text_or_ids, list)
            choices = server.route.array(server.route.member(answer, "choices", ""), "choices")
            first = server.route.mapping(choices[0] if choices else None, "choices[0]")
            token_ids = bool(extra) and first.get("token_ids") is not None
            break
        else:
            raise HttpError("POST", server.url + COMPLETIONS, "refused token-id and text prompts alike")
        if (first.get("logprobs") or {}).get("token_logprobs") is None:
            raise ConfigError(
                f"inference=openai: the server at {server.url} answers no log-probs (`logprobs`), which training needs"
            )
        return ServerFeatures(
            token_prompts=token_prompts,
            token_ids=token_ids,
            n=self._answers_n(server.client, {**base, "prompt": text_or_ids}),
            lora_routes=self._has_lora_route(server.client),
        )

    def _answers_n(self, client: HttpClient, body: dict[str, Any]) -> bool:
        try:
            answer = client.post(COMPLETIONS, {**body, "n": 2})
        except HttpError as error:
            if error.status not in (400, 422):
                raise
            return False
        return isinstance(answer, dict) and isinstance(answer.get("choices"), list) and len(answer["choices"]) == 2

    def _has_lora_route(self, client: HttpClient) -> bool:
        try:
            client.post(OPENAI_LORA_ROUTES.load, {}, max_retries=0)
        except HttpError as error:
            if error.status is None:
                raise
            return error.status not in (404, 405)  # a route that exists refuses the empty body
        return True
