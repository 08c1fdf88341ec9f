"""inference=vllm_server: sampling on a running vLLM server through its OpenAI-compatible `/v1/completions`.

Requests: token-id prompts, one request per prompt with n = G and the prompt's seed (vLLM seeds
completion g with seed + g; at T = 0 the prompt is repeated G times instead, since vLLM refuses
n > 1 for greedy requests), and every sampling value set explicitly (temperature, top_p, top_k,
min_p, penalties), since vLLM fills unset ones from the model's generation_config. Token ids and
log-probs come from `return_token_ids` (choices[i].token_ids) and `logprobs: 0`
(logprobs.token_logprobs, the sampled token's); finish_reason "length" marks a cut completion.

Log-prob semantics: vLLM reports log-probs of the raw logits unless the server runs with
`--logprobs-mode processed_logprobs` (launchers/vllm/serve.sh does), which applies temperature and
top-p first. The trainer recomputes log_softmax(logits / T), so the engine finds out at start which
mode the server runs and refuses raw log-probs at a temperature other than 0 or 1. With top_p < 1,
processed log-probs are those of the renormalized nucleus, above the trainer's by −log(nucleus
mass) (visible in policy/ratio_mean at the first update): top_p = 1 gives exact ratios.

Weights follow training through retrain.inference.served_adapters (`/v1/load_lora_adapter`,
which needs `--enable-lora` and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1). The freshness probe scores
the probe's continuation with `prompt_logprobs` (raw logits, i.e. T = 1) under the served adapter.
Every reply is read and checked through retrain.inference.replies.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from retrain.errors import ConfigError
from retrain.inference.base import NucleusLogprobsWarning
from retrain.inference.completions import (
    Completion,
    first_prompt,
    request_seed,
    rollouts_from_completions,
)
from retrain.inference.config import VllmServerEngineConfig
from retrain.inference.finish_reason import hit_max_tokens
from retrain.inference.http import HttpError
from retrain.inference.replies import ReplyLimits, ServerRoute, shown
from retrain.inference.served_adapters import LoraRoutes, ServedAdapters
from retrain.inference.server_engine import Server, ServerEngine
from retrain.model.probe import Probe
from retrain.model.resources import EngineResources
from retrain.plugins import built_in
from retrain.settings_object import takes_settings
from retrain.types import Rollouts, SamplingParams, WeightUpdate

log = logging.getLogger(__name__)

COMPLETIONS = "/v1/completions"
VLLM_LORA_ROUTES = LoraRoutes(
    load="/v1/load_lora_adapter",
    unload="/v1/unload_lora_adapter",
    server="vLLM",
    requirements="--enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 (launchers/vllm/serve.sh does both)",
)
# vLLM's own defaults for what a request leaves unset come from the model's generation_config
NEUTRAL_SAMPLING = {
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
}
MODE_CHECK_TEMPERATURE = 0.5  # processed log-probs at T = 0.5 double the gaps between log-probs at T = 1


@built_in
@takes_settings(VllmServerEngineConfig)
class VllmServerEngine(ServerEngine):
    """Samples on a vLLM server; see the module docstring."""

    adapters: ServedAdapters  # always: every request names a versioned adapter
    returns_entropies = False

    def __init__(self, config: VllmServerEngineConfig, tokenizer: Any, resources: EngineResources) -> None:
        super().__init__(config, tokenizer, resources, "vllm_server", COMPLETIONS)
        with self.closed_on_failure():
            self.base_model = self._base_model()
            prompt = Probe.from_tokenizer(tokenizer).prompt_ids
            tempered = {server.url: self._reports_tempered_logprobs(server, prompt) for server in self.servers}
            if len(set(tempered.values())) > 1:
                raise ConfigError(
                    f"inference.url: the vLLM servers differ in --logprobs-mode ({tempered}: True = temperature-"
                    "scaled); start every one alike (launchers/vllm/serve.sh)"
                )
            self.tempered_logprobs = next(iter(tempered.values()))
            self.adapters = ServedAdapters(
                self.clients, VLLM_LORA_ROUTES, resources, config.adapter_root, config.fault_skip_weight_sync
            )
        self.nucleus_warning = NucleusLogprobsWarning("the vLLM server")

    @property
    def weights_version(self) -> int:
        return self.adapters.version

    def generate(
        self,
        prompt_ids: list[list[int]],
        group_size: int,
        sampling: SamplingParams,
        generator_seed: int | None,
        row_offset: int = 0,
    ) -> Rollouts:
        first = first_prompt(row_offset, group_size)  # prompt i is the batch's first + i (a rank's share)
        self._check_semantics(sampling)
        groups = [
            [self._body(prompt, group_size, sampling, request_seed(generator_seed, first + index))]
            for index, prompt in enumerate(prompt_ids)
        ]
        limits = ReplyLimits(sampling.max_tokens, self.vocab_size)
        completions = [
            c
            for route, answers in self.post_groups(COMPLETIONS, groups, first)
            for c in self._completions(answers[0], group_size, limits, route)
        ]
        return rollouts_from_completions(prompt_ids, completions, group_size, sampling, self.tokenizer)

    def sync(self, update: WeightUpdate) -> None:
        self.adapters.sync(update)

    def probe_logprobs(self, probe: Probe) -> torch.Tensor:
        body = {
            "model": self._served_model(),
            "prompt": probe.prompt_ids + probe.completion_ids,
            "max_tokens": 1,
            "temperature": 0.0,
            "prompt_logprobs": 0,
            **NEUTRAL_SAMPLING,
        }
        server = self.next_probed()
        route = server.route
        response = server.client.post(COMPLETIONS, body)
        with route.reading("freshness-probe reply"):
            choices = route.array(route.member(response, "choices", ""), "choices")
            if not choices:
                route.fail("choices", "no choice")
            scored = route.array(
                route.member(choices[0], "prompt_logprobs", "choices[0]"), "choices[0].prompt_logprobs"
            )
            entries = scored[-len(probe.completion_ids) :]
            if len(entries) != len(probe.completion_ids):
                route.fail("choices[0].prompt_logprobs", f"{len(scored)} entries for a longer probe")
            field = "choices[0].prompt_logprobs"
            values = [
                route.member(route.member(entry, str(token), field), "logprob", f"{field}.{token}")
                for entry, token in zip(entries, probe.completion_ids)
            ]
            return torch.tensor(route.logprobs(values, field), dtype=torch.float32)

    def close(self) -> None:
        try:
            self.adapters.close()
        finally:
            self.close_clients()

    # ---- requests ----------------------------------------------------------------------------
    def _served_model(self, sampling: bool = False) -> str:
        """The model a request names: the newest adapter, or for a sampling request the version its batch is pinned
        to (sampling ahead); the base model before any adapter."""
        return (self.adapters.sampled_name() if sampling else self.adapters.served) or self.base_model

    def _body(self, prompt: list[int], group_size: int, sampling: SamplingParams, seed: int | None) -> dict[str, Any]:
        greedy = sampling.temperature == 0
        return {
            "model": self._served_model(sampling=True),
            "prompt": [prompt] * group_size if greedy else prompt,
            "n": 1 if greedy else group_size,
            "seed": seed,
            "max_tokens": sampling.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            **NEUTRAL_SAMPLING,
            "stop_token_ids": self.stop_ids,
            "skip_special_tokens": True,
            "logprobs": 0,
            "return_token_ids": True,
        }

    def _completions(self, response: Any, group_size: int, limits: ReplyLimits, route: ServerRoute) -> list[Completion]:
        """One prompt's G completions, in order, from a `/v1/completions` answer (checked: replies.py)."""
        with route.reading("completion"):
            choices = route.array(route.member(response, "choices", ""), "choices")
            if len(choices) != group_size:
                route.fail("choices", f"{len(choices)} completions for a prompt, expected {group_size}")
            indexed = sorted(
                (route.integer(route.member(choice, "index", f"choices[{i}]"), f"choices[{i}].index"), i)
                for i, choice in enumerate(choices)
            )
            completions = []
            for _, i in indexed:
                choice, field = choices[i], f"choices[{i}]"
                if choice.get("token_ids") is None:
                    route.fail(f"{field}.token_ids", "no token ids: the server must support return_token_ids")
                token_ids = route.token_ids(choice["token_ids"], f"{field}.token_ids")
                logprobs = route.member(route.member(choice, "logprobs", field), "token_logprobs", f"{field}.logprobs")
                finish = choice.get("finish_reason")
                cut = hit_max_tokens(route.url, finish)  # an aborted completion stops the run, as on openai
                if finish not in ("stop", "length"):
                    route.fail(f"{field}.finish_reason", f"{shown(finish)}, where stop or length belongs")
                completions.append(
                    route.completion(
                        token_ids,
                        route.logprobs(logprobs, f"{field}.logprobs.token_logprobs"),
                        cut,
                        limits,
                        field,
                    )
                )
            return completions

    # ---- what the server is ------------------------------------------------------------------
    def _base_model(self) -> str:
        """The base model's served name: the first model `/v1/models` lists that is no adapter (the same on
        every server of inference.url)."""
        names = {}
        for server in self.servers:
            route = ServerRoute("vllm_server", server.url + "/v1/models")
            models = route.array(route.member(server.client.get("/v1/models"), "data", ""), "data")
            bases = [
                route.text(route.member(model, "id", f"data[{i}]"), f"data[{i}].id")
                for i, model in enumerate(models)
                if not route.mapping(model, f"data[{i}]").get("parent")
            ]
            if not bases:
                raise HttpError("GET", server.url + "/v1/models", f"lists no base model: {models}")
            names[server.url] = bases[0]
        if len(set(names.values())) > 1:
            raise ConfigError(f"inference.url: the vLLM servers serve different base models ({names}): serve one")
        return next(iter(names.values()))

    def _reports_tempered_logprobs(self, server: Server, prompt: list[int]) -> bool:
        """Whether the server's log-probs follow the temperature (`--logprobs-mode processed_logprobs`):
        then the gap between the two likeliest tokens at T = 0.5 is twice the gap at T = 1."""
        gaps = []
        for temperature in (1.0, MODE_CHECK_TEMPERATURE):
            body = {
                "model": self.base_model,
                "prompt": prompt,
                "max_tokens": 1,
                "temperature": temperature,
                "top_p": 1.0,
                **NEUTRAL_SAMPLING,
                "seed": 0,
                "logprobs": 2,
                "return_tokens_as_token_ids": True,
            }
            answer = server.client.post(COMPLETIONS, body)
            with server.route.reading("log-prob mode check (choices[0].logprobs.top_logprobs)"):
                top = answer["choices"][0]["logprobs"]["top_logprobs"][0]
                best = sorted((float(value) for value in top.values()), reverse=True)
                gaps.append(best[0] - best[1])
        if gaps[0] < 1e-3:
            log.warning("could not tell which --logprobs-mode %s runs (a near tie on the check prompt)", server.url)
            return True
        ratio = gaps[1] / gaps[0]
        tempered = ratio > (1 + 1 / MODE_CHECK_TEMPERATURE) / 2
        log.info("vLLM at %s reports %s log-probs", server.url, "temperature-scaled" if tempered else "raw")
        return tempered

    def _check_semantics(self, sampling: SamplingParams) -> None:
        if sampling.temperature not in (0.0, 1.0) and not self.tempered_logprobs:
            raise ConfigError(
                f"inference=vllm_server: the vLLM server at {self.url} reports log-probs of the raw logits, but "
                f"training.temperature={sampling.temperature} needs those of the temperature-scaled distribution "
                "(what the trainer recomputes); start it with --logprobs-mode processed_logprobs "
                "(launchers/vllm/serve.sh does)"
            )
        self.nucleus_warning.check(sampling)
