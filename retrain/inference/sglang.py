"""inference=sglang: sampling on a running SGLang server through its native `/generate` API.

Requests: one per prompt, its token ids repeated G times in `input_ids` (a batch), each copy with
its own `sampling_params`: the prompt's seed + g as `sampling_seed` (SGLang honours it when started
with --enable-deterministic-inference) and every value explicit (temperature, top_p, top_k = -1,
min_p, penalties, max_new_tokens, stop_token_ids), since SGLang fills unset ones from the model's
generation_config. `return_logprob: true` answers meta_info.output_token_logprobs as
[log-prob, token id, text] triples (the stop token included), and meta_info.finish_reason
{"type": "length"} marks a completion cut by max_new_tokens. `lora_path` names the served adapter.

Log-prob semantics: SGLang reports log-probs after temperature and top-p, which is what the
trainer recomputes at top_p = 1 (the server must not set SGLANG_RETURN_ORIGINAL_LOGPROB, which
reports those of the raw logits). With top_p < 1 they are those of the renormalized nucleus, as
with vLLM (docs/inference-engines.md).

Weights follow training through retrain.inference.served_adapters (`/load_lora_adapter`,
`/unload_lora_adapter`; the server needs --enable-lora, --max-lora-rank and --lora-target-modules).
The freshness probe scores the probe's continuation from meta_info.input_token_logprobs
(`return_logprob` with `logprob_start_len`) at T = 1 under the served adapter. Every reply is read
and checked through retrain.inference.replies.
"""

from __future__ import annotations

from typing import Any

import torch

from retrain.inference.base import NucleusLogprobsWarning
from retrain.inference.completions import Completion, first_prompt, request_seed, rollouts_from_completions
from retrain.inference.config import SglangEngineConfig
from retrain.inference.replies import ReplyLimits, ServerRoute, shown
from retrain.inference.served_adapters import LoraRoutes, ServedAdapters
from retrain.inference.server_engine import ServerEngine
from retrain.model.probe import Probe
from retrain.model.resources import EngineResources
from retrain.plugins import built_in
from retrain.settings_object import takes_settings
from retrain.types import Rollouts, SamplingParams, WeightUpdate

GENERATE = "/generate"
SGLANG_LORA_ROUTES = LoraRoutes(
    load="/load_lora_adapter",
    unload="/unload_lora_adapter",
    server="SGLang",
    requirements="--enable-lora, --lora-target-modules covering model.target_modules",
)
NEUTRAL_SAMPLING = {
    "top_k": -1,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
}


@built_in
@takes_settings(SglangEngineConfig)
class SglangEngine(ServerEngine):
    """Samples on an SGLang server; see the module docstring."""

    adapters: ServedAdapters  # always: every request names a versioned adapter
    returns_entropies = False

    def __init__(self, config: SglangEngineConfig, tokenizer: Any, resources: EngineResources) -> None:
        super().__init__(config, tokenizer, resources, "sglang", GENERATE)
        self.nucleus_warning = NucleusLogprobsWarning("SGLang")
        with self.closed_on_failure():
            for client in self.clients:
                client.get("/health")
            self.adapters = ServedAdapters(
                self.clients, SGLANG_LORA_ROUTES, resources, config.adapter_root, config.fault_skip_weight_sync
            )

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
        self.nucleus_warning.check(sampling)
        groups = [
            [self._body(prompt, group_size, sampling, request_seed(generator_seed, first + index))]
            for index, prompt in enumerate(prompt_ids)
        ]
        limits = ReplyLimits(sampling.max_tokens, self.vocab_size)
        completions = [
            c
            for route, answers in self.post_groups(GENERATE, groups, first)
            for c in self._completions(answers[0], group_size, limits, route)
        ]
        return rollouts_from_completions(prompt_ids, completions, group_size, sampling, self.tokenizer)

    def sync(self, update: WeightUpdate) -> None:
        self.adapters.sync(update)

    def probe_logprobs(self, probe: Probe) -> torch.Tensor:
        body: dict[str, Any] = {
            "input_ids": probe.prompt_ids + probe.completion_ids,
            "sampling_params": {"max_new_tokens": 1, "temperature": 1.0, "top_p": 1.0, **NEUTRAL_SAMPLING},
            "return_logprob": True,
            "logprob_start_len": 0,
            "lora_path": self.adapters.served,
        }
        server = self.next_probed()
        answer = server.client.post(GENERATE, body)
        route, field = server.route, "meta_info.input_token_logprobs"
        with route.reading("freshness-probe reply"):
            meta = route.member(answer, "meta_info", "")
            scored = route.array(route.member(meta, "input_token_logprobs", "meta_info"), field)
            scored = scored[-len(probe.completion_ids) :]
            if [entry[1] for entry in scored] != probe.completion_ids:
                route.fail(field, f"scores of tokens {scored} instead of the probe's {probe.completion_ids}")
            return torch.tensor(route.logprobs([entry[0] for entry in scored], field), dtype=torch.float32)

    def close(self) -> None:
        try:
            self.adapters.close()
        finally:
            self.close_clients()

    def _body(self, prompt: list[int], group_size: int, sampling: SamplingParams, seed: int | None) -> dict[str, Any]:
        params = {
            "max_new_tokens": sampling.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            **NEUTRAL_SAMPLING,
            "stop_token_ids": self.stop_ids,
            "skip_special_tokens": True,
        }
        return {
            "input_ids": [prompt] * group_size,
            "sampling_params": [
                params if seed is None else {**params, "sampling_seed": seed + g} for g in range(group_size)
            ],
            "return_logprob": True,
            "lora_path": [self.adapters.sampled_name()] * group_size,
        }

    def _completions(self, answer: Any, group_size: int, limits: ReplyLimits, route: ServerRoute) -> list[Completion]:
        """One prompt's G completions, in order, from a batched `/generate` answer (checked: replies.py)."""
        with route.reading("completion"):
            items = route.array(answer, "(the reply)")
            if len(items) != group_size:
                route.fail("(the reply)", f"{len(items)} completions for a batch of {group_size} copies of a prompt")
            completions = []
            for i, item in enumerate(items):
                field = f"[{i}].meta_info"
                meta = route.member(item, "meta_info", f"[{i}]")
                triples = route.array(
                    route.member(meta, "output_token_logprobs", field), f"{field}.output_token_logprobs"
                )
                entries = [
                    route.array(triple, f"{field}.output_token_logprobs[{t}]") for t, triple in enumerate(triples)
                ]
                if any(len(entry) < 2 for entry in entries):
                    route.fail(f"{field}.output_token_logprobs", "an entry without [log-prob, token id]")
                reason = route.member(meta, "finish_reason", field)
                finish = reason.get("type") if isinstance(reason, dict) else None
                if finish not in ("stop", "length"):
                    route.fail(f"{field}.finish_reason", f"{shown(reason)}, where {{type: stop or length}} belongs")
                ids_field, logprobs_field = (
                    f"{field}.output_token_logprobs[*][1]",
                    f"{field}.output_token_logprobs[*][0]",
                )
                completions.append(
                    route.completion(
                        route.token_ids([entry[1] for entry in entries], ids_field),
                        route.logprobs([entry[0] for entry in entries], logprobs_field),
                        finish == "length",
                        limits,
                        f"[{i}]",
                    )
                )
            return completions
