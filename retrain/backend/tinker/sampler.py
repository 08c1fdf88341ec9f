"""The inference engine of backend=tinker: the service's sampling client of the newest weights.

The backend publishes each optimizer step's weights as sampler weights named `policy-v{N}` and hands
their `tinker://` path over in a WeightUpdate; `sync` opens a sampling client on that path, so a
step never samples with a client of older weights. Each prompt is one request for its G samples,
seeded from the step's generator seed; requests go out together, as many at once as
`backend.max_concurrent_calls` allows across the campaign.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from retrain.backend.tinker.calls import RemoteCalls, TinkerServiceError
from retrain.inference.completions import Completion, request_seed, rollouts_from_completions, stop_token_ids
from retrain.model.probe import Probe, StaleWeightsError
from retrain.plugins import built_in
from retrain.types import Rollouts, SamplingParams, WeightUpdate


@built_in
class TinkerSampler:
    """Satisfies retrain.inference.base.InferenceEngine; see the module docstring."""

    returns_entropies = False  # the service returns the sampled tokens' log-probs, not the distributions

    def __init__(self, service: Any, calls: RemoteCalls, tokenizer: Any, initial: WeightUpdate) -> None:
        self.sdk = calls.sdk
        self.service = service
        self.calls = calls
        self.tokenizer = tokenizer
        self.stop = stop_token_ids(tokenizer)
        self.client: Any = None
        self.model_path: str | None = None
        self.weights_version = -1
        self.sync(initial)

    def sync(self, update: WeightUpdate) -> None:
        if update.remote is None:
            raise ValueError("backend=tinker samples with weights on the service: its WeightUpdate names their path")
        if update.version < self.weights_version:
            raise StaleWeightsError(
                f"asked to sample with weights version {update.version}, older than version {self.weights_version}"
            )
        path = update.remote
        self.client = self.calls.run(
            f"opening a sampling client on {path}",
            lambda: self.service.create_sampling_client(model_path=path).result(),
        )
        self.model_path = path
        self.weights_version = update.version

    def generate(
        self, prompt_ids: list[list[int]], group_size: int, sampling: SamplingParams, generator_seed: int | None
    ) -> Rollouts:
        client, sdk = self.client, self.sdk

        def request(index: int, prompt: list[int]) -> Callable[[], Any]:
            params = sdk.SamplingParams(
                max_tokens=sampling.max_tokens,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                seed=request_seed(generator_seed, index),
                stop=self.stop,
            )
            model_input = sdk.ModelInput.from_ints(prompt)
            return lambda: client.sample(prompt=model_input, num_samples=group_size, sampling_params=params).result()

        responses = self.calls.map("sampling", [request(i, prompt) for i, prompt in enumerate(prompt_ids)])
        completions = [
            completion for response in responses for completion in _completions(response, group_size, self.model_path)
        ]
        return rollouts_from_completions(prompt_ids, completions, group_size, sampling, self.tokenizer)

    def probe_logprobs(self, probe: Probe) -> torch.Tensor:
        """The sampling client's own log-prob computation of the probe's continuation (prompt log-probs
        of prompt + continuation, the last K of them)."""
        count = len(probe.completion_ids)
        model_input = self.sdk.ModelInput.from_ints(probe.prompt_ids + probe.completion_ids)
        client = self.client
        values = self.calls.run(
            "scoring the freshness probe on the sampler",
            lambda: client.compute_logprobs(model_input, prompt_logprobs_last_n=count).result(),
        )
        last = list(values)[-count:]
        if len(last) != count or any(value is None for value in last):
            raise TinkerServiceError(f"Tinker's sampler returned no log-probs for the probe's last {count} tokens")
        return torch.tensor(last, dtype=torch.float32)

    def close(self) -> None:
        self.client = None


def _completions(response: Any, group_size: int, model_path: str | None) -> list[Completion]:
    """One prompt's G sequences as Completions (the stop token, when one ended it, is part of the tokens)."""
    if len(response.sequences) != group_size:
        raise TinkerServiceError(
            f"Tinker's sampler ({model_path}) returned {len(response.sequences)} sequences for a prompt, "
            f"asked for {group_size}"
        )
    completions = []
    for sequence in response.sequences:
        if sequence.logprobs is None:
            raise TinkerServiceError(f"Tinker's sampler ({model_path}) returned a sequence without log-probs")
        completions.append(
            Completion(
                token_ids=list(sequence.tokens),
                logprobs=list(sequence.logprobs),
                hit_max_tokens=sequence.stop_reason == "length",
            )
        )
    return completions
