"""Sampling on the PRIME-RL inference server, and making it serve each broadcast.

The PRIME-RL inference server is a vLLM OpenAI-compatible server with a few routes of its own, so
generation and the freshness probe are VllmServerEngine's (`/v1/completions`); only how weights
follow training differs. `ServerReloads` takes the place of VllmServerEngine's runtime-LoRA
follower and replays what PRIME-RL's orchestrator sends (src/prime_rl/utils/client.py and
src/prime_rl/inference/vllm/server.py of PRIME-RL v0.8.1.dev67, commit 559b44772e47):

- an adapter broadcast: POST /load_lora_adapter {"lora_name", "lora_path": <broadcast dir>} (PRIME-RL's
  wrapper of vLLM's route, loading in place). retrain names every version anew (`policy-v{N}`) and
  unloads the previous name through vLLM's /v1/unload_lora_adapter: a new name also gets a new
  prefix-cache key, so no KV computed under older weights is reused.
- full weights: POST /pause?mode=keep&clear_cache=false, POST /update_weights {"weight_dir": <dir>},
  POST /resume (always, even when the update failed). The served name stays the base model's, and
  vLLM's prefix cache is not reset: PRIME-RL salts requests per version, which this engine does not,
  so a prompt repeated across versions may reuse KV of older weights. Train LoRA in PRIME-RL for exact
  freshness (a warning says so once).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from retrain.backend.prime_rl.weights import is_adapter
from retrain.inference.adapters import adapter_name
from retrain.inference.config import VllmServerEngineConfig
from retrain.inference.http import HttpClient, HttpError
from retrain.inference.vllm_server import VllmServerEngine
from retrain.model.probe import Probe, StaleWeightsError
from retrain.model.resources import EngineResources
from retrain.model.spec import ModelSpec
from retrain.types import Rollouts, SamplingParams, WeightUpdate

log = logging.getLogger(__name__)

LOAD_ADAPTER = "/load_lora_adapter"
UNLOAD_ADAPTER = "/v1/unload_lora_adapter"
PAUSE = "/pause?mode=keep&clear_cache=false"
UPDATE_WEIGHTS = "/update_weights"
RESUME = "/resume"


class ServerReloads:
    """Makes the PRIME-RL server serve each broadcast (see the module docstring). It offers what
    VllmServerEngine reads of its weights follower: `served`, `sampled_name`, `version`, `sync`, `close`."""

    def __init__(self, client: HttpClient) -> None:
        self.client = client
        self.version = 0
        self.served: str | None = None  # the adapter requests name; None = the base model
        self._warned_prefix_cache = False

    def sync(self, update: WeightUpdate) -> None:
        if update.version < self.version:
            raise StaleWeightsError(
                f"asked to sync to weights version {update.version}, but {self.client.base_url} already "
                f"serves version {self.version}"
            )
        if update.adapter_dir is None:
            raise ValueError("the PRIME-RL server loads broadcast directories: the update names no adapter_dir")
        if is_adapter(update.adapter_dir):
            self._load_adapter(adapter_name(update.version), str(update.adapter_dir))
        else:
            self._update_weights(str(update.adapter_dir))
        self.version = update.version

    def sampled_name(self) -> str | None:
        """The adapter sampling requests name: the served one (PRIME-RL samples on-policy, one version at a time)."""
        return self.served

    def close(self) -> None:
        """Unload the served adapter (best effort: the server may be gone)."""
        if self.served is None:
            return
        try:
            self.client.post(UNLOAD_ADAPTER, {"lora_name": self.served}, max_retries=0)
        except HttpError as error:
            log.warning("could not unload %s from %s: %s", self.served, self.client.base_url, error)
        self.served = None

    def _load_adapter(self, name: str, path: str) -> None:
        self.client.post(LOAD_ADAPTER, {"lora_name": name, "lora_path": path})
        previous, self.served = self.served, name
        if previous is not None and previous != name:
            try:
                self.client.post(UNLOAD_ADAPTER, {"lora_name": previous})
            except HttpError as error:  # harmless: no request names it any more
                log.warning("could not unload %s from %s: %s", previous, self.client.base_url, error)

    def _update_weights(self, weight_dir: str) -> None:
        if not self._warned_prefix_cache:
            self._warned_prefix_cache = True
            log.warning(
                "PRIME-RL broadcasts full weights: vLLM's prefix cache is not reset on /update_weights, so a prompt "
                "seen under older weights may reuse their KV; train LoRA in PRIME-RL for exact freshness"
            )
        self.client.post(PAUSE, {})
        try:
            self.client.post(UPDATE_WEIGHTS, {"weight_dir": weight_dir})
        finally:
            self.client.post(RESUME, {})
        self.served = None


class PrimeRlEngine:
    """Satisfies retrain.inference.base.InferenceEngine; see the module docstring."""

    returns_entropies = False

    def __init__(self, tokenizer: Any, spec: ModelSpec, url: str) -> None:
        resources = EngineResources(spec=spec, device=torch.device("cpu"))
        self.sampler = VllmServerEngine(VllmServerEngineConfig(url=url), tokenizer, resources)
        self.sampler.adapters.close()  # it loaded nothing (no live model): its publisher's temp dir goes
        self.reloads = ServerReloads(self.sampler.client)
        self.sampler.adapters = self.reloads  # type: ignore[assignment]  # the follower contract above
        self.weights_version = 0

    def generate(
        self, prompt_ids: list[list[int]], group_size: int, sampling: SamplingParams, generator_seed: int | None
    ) -> Rollouts:
        return self.sampler.generate(prompt_ids, group_size, sampling, generator_seed)

    def interrupt(self) -> None:
        """Cancel a `generate` in flight (a stop request): it raises SamplingInterrupted."""
        self.sampler.interrupt()

    def sync(self, update: WeightUpdate) -> None:
        self.reloads.sync(update)
        self.weights_version = self.reloads.version

    def probe_logprobs(self, probe: Probe) -> torch.Tensor:
        return self.sampler.probe_logprobs(probe)

    def close(self) -> None:
        self.sampler.close()
