"""In-process sampling on the very model object the backend trains (no second copy of the model).

Built from the run's tokenizer and the backend's EngineResources, whose `model` it samples with
(in split mode, `resources.overlap`, a copy of it on the inference device, kept current by `sync`).

The B×G rows decode together under a KV budget (`inference.kv_cache_gb`, else the memory plan's
`resources.kv_cache_bytes`, else the device's free memory less a margin): keys and values live in a paged
pool that grows with the live tokens; rows that do not fit wait and enter as others finish, and a row that
must give way re-enters later by prefilling what it had (retrain/inference/sampler/). Each token is drawn
with a uniform that is a hash of (seed, row, position), so the budget, the batching and preemption never
change what is sampled. With `prefix_caching` each prompt is prefilled once and its blocks shared by its G rows.
A row stops at a stop token or after max_tokens. `generate_requests` samples the single-completion requests of the
loopback endpoint (retrain.inference.request_batcher) in one such batch, each with its own seed and max_tokens,
answers each as its row finishes, and admits the requests that arrive while it decodes.

Log-prob semantics: the recorded log-prob of a sampled token is log_softmax(logits / T) of the full
temperature-scaled distribution, before top-p truncation — the quantity the trainer recomputes, so
the first-update importance ratio is 1. The token itself is drawn from the top-p nucleus of that
distribution; the mean probability mass the nucleus kept is reported as `policy/top_p_mass`.
Temperature 0 is greedy (argmax); its log-probs and entropies are those of the T = 1 distribution.
Rollouts come back as CPU tensors whatever the device; `Rollouts.metrics` adds the KV cache's peak
(`engine/kv_peak_gb`) and the most rows that waited for room (`engine/rows_waiting_max`). An fp32 model's LoRA
layers sample through merged weights W + s·B·A (`merge_lora`, retrain/model/merged_lora.py): one matmul
instead of three; other plain LoRA layers (bf16/fp16) compute PEFT's ops without its per-call bookkeeping
(`lean_lora`).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from peft import set_peft_model_state_dict
from peft.utils import load_peft_weights
from torch.utils._triton import has_triton

from retrain.errors import ConfigError
from retrain.inference.completions import Completion, stop_token_ids
from retrain.inference.config import PytorchEngineConfig
from retrain.inference.requests import MoreRequests, TokenRequest
from retrain.inference.sampler.counter_random import CounterUniforms
from retrain.inference.sampler.decode import (
    GPU_STOP_CHECK_STEPS,
    Arrival,
    Arrivals,
    Decoded,
    Finished,
    Prompts,
    decode,
)
from retrain.inference.sampler.kv_budget import budget_blocks, kv_budget
from retrain.inference.sampler.kv_pool import KvPool, KvShape
from retrain.inference.sampler.step_graphs import Recorder, Step, cuda_graph_recorder
from retrain.model.attention_kernels import attending_with, attention_implementation
from retrain.model.lean_decoder import MIRRORED, mirrored
from retrain.model.logprobs import left_pad
from retrain.model.merged_lora import lean_lora, merged_lora, plain_lora_layers
from retrain.model.output_logits import use_fp32_logits
from retrain.model.probe import Probe, StaleWeightsError
from retrain.model.resources import EngineResources
from retrain.model.train_mode import set_training
from retrain.plugins import built_in
from retrain.settings_object import takes_settings
from retrain.types import Rollouts, SamplingParams, WeightUpdate

log = logging.getLogger(__name__)


@built_in
@takes_settings(PytorchEngineConfig)
class PytorchEngine:
    """Samples with the (PEFT-wrapped) model the backend trains; see the module docstring."""

    returns_entropies = True

    def __init__(self, config: PytorchEngineConfig, tokenizer: Any, resources: EngineResources) -> None:
        if resources.model is None:
            raise ConfigError(
                "inference=pytorch samples in-process with the training model, but the backend "
                "shares none; choose an engine that loads its own weights"
            )
        self.model = resources.model
        if resources.overlap:  # split mode: sample with a copy on our own device while the backend trains
            self.model = copy.deepcopy(resources.model).to(resources.device)
            use_fp32_logits(self.model)  # where the copy's device writes fp32 logits and the backend's does not
        self.tokenizer = tokenizer
        self.device = torch.device(resources.device)
        self._attention = attention_implementation(config.attention_kernel, self.device, self.model.dtype)
        self.prefix_caching = config.prefix_caching
        self.kv_cache_gb = config.kv_cache_gb
        self.stop_check_steps = config.stop_check_steps or (GPU_STOP_CHECK_STEPS if self.device.type == "cuda" else 1)
        self.paged_attention = reads_the_pool(config.paged_attention, self.model, self.device)
        # a sampling call's recorder of decode steps (CUDA graphs); None: steps run eagerly
        self.step_recorder: Callable[[], Recorder] | None = None
        if records_steps(config.cuda_graphs, self.paged_attention, self.device):
            self.step_recorder = lambda: cuda_graph_recorder(self.device)
        self._graphs_required = config.cuda_graphs is True
        self.planned_kv_bytes = resources.kv_cache_bytes
        self.kv_shape = KvShape.of(self.model.config, self.model.dtype, config.kv_block_tokens)
        self.layer_types = getattr(self.model.config.get_text_config(), "layer_types", None)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.eos_ids = torch.tensor(
            stop_token_ids(tokenizer, getattr(self.model, "generation_config", None)), device=self.device
        )
        if self.pad_id is None or not len(self.eos_ids):
            raise ValueError("the tokenizer defines no EOS/pad token: completions could never stop")
        self.weights_version = 0
        self._parameters = dict(self.model.named_parameters())  # walking the modules per sync costs ~1 ms
        # The fault hook (a test of the freshness proof): keep serving the initial adapter, as an
        # engine that never received a push would, by swapping it in around every forward.
        self._frozen = _trainable_copy(self.model) if config.fault_skip_weight_sync else None
        lora_layers = plain_lora_layers(self.model)
        self._merged = merged_lora(lora_layers) if config.merge_lora else None
        merged = [] if self._merged is None else self._merged.layers
        self._lean = [layer for layer in lora_layers if layer not in merged]  # PEFT's arithmetic, leaner
        if self._merged is not None:
            log.info("inference=pytorch samples through merged LoRA weights (%d fp32 layers)", len(self._merged.layers))

    def generate(
        self,
        prompt_ids: list[list[int]],
        group_size: int,
        sampling: SamplingParams,
        generator_seed: int | None,
        row_offset: int = 0,
    ) -> Rollouts:
        """Sample `group_size` completions of each prompt; `generator_seed` None draws a seed from torch's RNG.
        `row_offset`: the global index of this call's first row, when a data-parallel rank samples its share of a
        batch (its rows then draw what one process sampling the whole batch draws for them)."""
        _check_sampling(group_size, sampling)
        uniforms = None
        if sampling.temperature > 0:
            seed = generator_seed if generator_seed is not None else _drawn_seed()
            uniforms = CounterUniforms(seed, row_offset).table(
                len(prompt_ids) * group_size, sampling.max_tokens, self.device
            )
        prompts, prompt_mask, decoded = self._sample(prompt_ids, group_size, sampling, uniforms, None)
        return self._rollouts(prompts, prompt_mask, group_size, sampling, decoded)

    def generate_requests(
        self,
        requests: list[TokenRequest],
        on_done: Callable[[int, Completion], None] | None = None,
        more: MoreRequests | None = None,
    ) -> list[Completion]:
        """One completion per request, all sampled in one continuous batch (the request batcher's call; the
        requests share temperature and top_p, each has its own max_tokens and seed). Request i draws its token at
        position p with the uniform of (its seed, row 0, p): what `generate([prompt], 1, ...)` draws for it alone,
        so its tokens do not depend on which requests share the batch. `on_done(i, completion)` is called as
        request i finishes, before the batch does.

        `more(fits)`, when given, is asked before every decode step for requests that arrived since: it hands over
        those `fits` accepts (the batch's temperature and top_p, at most its max_tokens, within the KV budget), which
        join the running batch numbered after the requests so far (the returned list and `on_done` number them so);
        the call ends when no request runs, waits or arrives. Prefix caching is off for such a call."""
        first = requests[0].sampling
        for request in requests:
            _check_sampling(1, request.sampling)
            if (request.sampling.temperature, request.sampling.top_p) != (first.temperature, first.top_p):
                raise ValueError("the requests of one batch must share temperature and top_p")
        limits = [request.sampling.max_tokens for request in requests]
        sampling = SamplingParams(max_tokens=max(limits), temperature=first.temperature, top_p=first.top_p)
        uniforms = None
        if sampling.temperature > 0:
            uniforms = torch.cat([self._request_uniforms(request, sampling.max_tokens) for request in requests])
        finished = None
        if on_done is not None:

            def finished(row: int, ids: torch.Tensor, logprobs: torch.Tensor, stopped: bool) -> None:
                on_done(row, Completion(ids.tolist(), logprobs.tolist(), hit_max_tokens=not stopped))

        prompt_ids = [request.prompt_ids for request in requests]
        _, _, decoded = self._sample(prompt_ids, 1, sampling, uniforms, limits, finished, more)
        return _completions(decoded)

    def _request_uniforms(self, request: TokenRequest, max_tokens: int) -> torch.Tensor:
        """[1, max_tokens]: the uniforms request draws alone (its seed, row 0); a seed drawn when it names none."""
        seed = request.seed if request.seed is not None else _drawn_seed()
        return CounterUniforms(seed).table(1, max_tokens, self.device)

    def _sample(
        self,
        prompt_ids: list[list[int]],
        group_size: int,
        sampling: SamplingParams,
        uniforms: torch.Tensor | None,
        limits: list[int] | None,
        on_finish: Finished | None = None,
        more: MoreRequests | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, Decoded]:
        """Decode every row under the KV budget with the rows' `uniforms` ([N, max_tokens]; None at T = 0): the
        left-padded prompts, their mask, and what the loop sampled (rows that joined it included)."""
        prompts, prompt_mask = left_pad(prompt_ids, self.pad_id, self.device)
        lengths = prompt_mask.sum(dim=1).tolist()
        record = self._recorder()  # this call's: the memory of its graphs goes when it does
        sink = record is not None  # the recorded steps' padding rows write to a block of their own
        blocks = budget_blocks(
            kv_budget(self.kv_cache_gb, self.planned_kv_bytes, self.device),
            self.kv_shape,
            max(lengths) + sampling.max_tokens,
            sink,
        )
        set_training(self.model, False)  # no dropout; it stays so until the backend trains
        with torch.inference_mode(), self._serving():
            decoded = decode(
                self.model,
                KvPool(self.kv_shape, self.device, blocks, reserve=self.device.type == "cuda" or sink, sink=sink),
                self.layer_types,
                Prompts(prompts, lengths, group_size),
                sampling,
                uniforms,
                self.eos_ids,
                self.pad_id,
                self.prefix_caching and more is None,
                limits,
                on_finish,
                None if more is None else self._arrivals(more, sampling, blocks - sink),
                self.stop_check_steps,
                self.paged_attention,
                record,
            )
        return prompts, prompt_mask, decoded

    def _recorder(self) -> Recorder | None:
        """This call's recorder of decode steps, if they are recorded. Where the setting is automatic, a step that
        cannot be recorded runs eagerly instead, and so do the engine's later calls (said once, in a warning)."""
        if self.step_recorder is None:
            return None
        record = self.step_recorder()
        if self._graphs_required:
            return record

        def record_or_run(step: Step) -> tuple[torch.Tensor, Step]:
            if self.step_recorder is None:  # failed earlier in this call
                return step(), step
            try:
                return record(step)
            except Exception as error:  # a recorder's failure on a device never tried before: sample on
                log.warning(
                    "inference.cuda_graphs (automatic): a decode step could not be recorded (%s: %s); decode steps "
                    "run eagerly from now on (set inference.cuda_graphs=false to skip recording)",
                    type(error).__name__,
                    error,
                )
                self.step_recorder = None
                return step(), step

        return record_or_run

    def _arrivals(self, more: MoreRequests, sampling: SamplingParams, blocks: int) -> Arrivals:
        """The rows of the requests `more` hands over, for decode to admit into the running call; `blocks`: the
        rows' budget."""

        def fits(request: TokenRequest) -> bool:
            asked = request.sampling
            longest = len(request.prompt_ids) + asked.max_tokens
            return (
                (asked.temperature, asked.top_p) == (sampling.temperature, sampling.top_p)
                and 1 <= asked.max_tokens <= sampling.max_tokens
                and 0 < len(request.prompt_ids)
                and self.kv_shape.blocks_for(longest) + 1 <= blocks  # as budget_blocks checks
            )

        def arrivals() -> list[Arrival]:
            return [
                Arrival(
                    torch.tensor(request.prompt_ids, dtype=torch.long, device=self.device),
                    request.sampling.max_tokens,
                    None if sampling.temperature == 0 else self._request_uniforms(request, sampling.max_tokens)[0],
                )
                for request in more(fits)
            ]

        return arrivals

    def _rollouts(
        self,
        prompts: torch.Tensor,
        prompt_mask: torch.Tensor,
        group_size: int,
        sampling: SamplingParams,
        decoded: Decoded,
    ) -> Rollouts:
        ids, mask, logprobs, entropies, kept_mass, finished, metrics = decoded
        width = int(mask.sum(dim=1).max())
        completion_ids, completion_mask = _export(ids[:, :width]), _export(mask[:, :width])
        if sampling.temperature > 0:
            metrics = {"policy/top_p_mass": float(kept_mass[mask].mean()), **metrics}
        return Rollouts(
            prompt_ids=_export(prompts),
            prompt_mask=_export(prompt_mask),
            completion_ids=completion_ids,
            completion_mask=completion_mask,
            logprobs=_export(logprobs[:, :width]),
            texts=self.tokenizer.batch_decode(
                [row[row_mask].tolist() for row, row_mask in zip(completion_ids, completion_mask)],
                skip_special_tokens=True,
            ),
            group_size=group_size,
            hit_max_tokens=_export(~finished),
            entropies=_export(entropies[:, :width]) if entropies is not None else None,
            temperature=sampling.temperature,
            metrics=metrics,
        )

    def sync(self, update: WeightUpdate) -> None:
        """Load the update's weights into the model sampled with. Tensors that are this model's own
        parameters (the backend shares its model) are already in place and are not copied."""
        if update.version < self.weights_version:
            raise StaleWeightsError(
                f"asked to sync to weights version {update.version}, but the engine already "
                f"serves version {self.weights_version}"
            )
        if self._frozen is not None:
            log.warning("inference.fault_skip_weight_sync: weights version %d NOT pushed to the engine", update.version)
            return
        if update.adapter_dir is not None:
            set_peft_model_state_dict(self.model, load_peft_weights(str(update.adapter_dir), device=str(self.device)))
        else:
            assert update.tensors is not None
            parameters = self._parameters
            unknown = sorted(update.tensors.keys() - parameters.keys())
            if unknown:
                raise ValueError(f"weight update {update.version} names parameters this model lacks: {unknown[:5]}")
            with torch.no_grad():
                for name, tensor in update.tensors.items():
                    if parameters[name] is not tensor:
                        parameters[name].copy_(tensor)
        self.weights_version = update.version

    def probe_logprobs(self, probe: Probe) -> torch.Tensor:
        """Log-probs at T = 1 of the probe's continuation under the weights `generate` samples with
        (merged LoRA, the fault hook): one forward of prompt and continuation. The engine's KV caches
        live within one call, so only those weights can be stale, and this forward reads them."""
        set_training(self.model, False)  # no dropout; it stays so until the backend trains
        with torch.inference_mode(), self._serving():
            return _export(probe.logprobs_under(self.model, self.device))

    @contextmanager
    def _serving(self) -> Iterator[None]:
        """The weights to sample with: the model's own, or (fault hook) the frozen initial adapter;
        through merged LoRA weights where `merge_lora` applies (merged after the swap), the lean forward elsewhere;
        attending with `inference.attention_kernel`."""
        merged = self._merged.serving() if self._merged is not None else nullcontext()
        with self._frozen_adapter(), lean_lora(self._lean), merged, attending_with(self.model, self._attention):
            yield

    @contextmanager
    def _frozen_adapter(self) -> Iterator[None]:
        """The fault hook: the initial adapter swapped in for the block, the live one restored after."""
        if self._frozen is None:
            yield
            return
        live = _trainable_copy(self.model)
        _load_trainable(self.model, self._frozen)
        try:
            yield
        finally:
            _load_trainable(self.model, live)

    def close(self) -> None:
        """Nothing to release: the model belongs to the backend."""


def _check_sampling(group_size: int, sampling: SamplingParams) -> None:
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if sampling.max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {sampling.max_tokens}")
    if sampling.temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {sampling.temperature}")
    if not 0 < sampling.top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {sampling.top_p}")


def _completions(decoded: Decoded) -> list[Completion]:
    """Each row's sampled ids and log-probs, and whether max_tokens cut it, from the decode loop's tensors."""
    lengths = decoded.mask.sum(dim=1).tolist()
    ids, logprobs, finished = decoded.ids.cpu(), decoded.logprobs.cpu(), decoded.finished.cpu()
    return [
        Completion(ids[n, :length].tolist(), logprobs[n, :length].tolist(), hit_max_tokens=not bool(finished[n]))
        for n, length in enumerate(lengths)
    ]


def _drawn_seed() -> int:
    """A seed from torch's RNG, for a call that names none."""
    return int(torch.randint(2**63 - 1, ()))


def _trainable_copy(model: Any) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


def _load_trainable(model: Any, tensors: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in tensors:
                p.copy_(tensors[name])


def _export(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU copy made outside inference mode, so the trainer can use it next to autograd tensors."""
    return tensor.to("cpu", copy=True)


def records_steps(setting: bool | None, reads_pool: bool, device: torch.device) -> bool:
    """Whether decode steps are recorded as CUDA graphs (inference.cuda_graphs): on CUDA where attention reads the
    pool (a gathered copy's shapes change every step); automatic (None): wherever that holds."""
    if setting is True and device.type != "cuda":
        raise ConfigError(f"inference.cuda_graphs=true records CUDA graphs, but the engine samples on {device.type}")
    if setting is True and not reads_pool:
        raise ConfigError(
            "inference.cuda_graphs=true needs attention that reads the KV pool (inference.paged_attention=flex or "
            "auto): the gathered copy's shapes change every step"
        )
    return setting is not False and device.type == "cuda" and reads_pool


def reads_the_pool(mode: str, model: Any, device: torch.device) -> bool:
    """Whether attention reads cached keys from the KV pool through the block tables (inference.paged_attention):
    flex, or auto on a GPU (eager flex_attention on the CPU scores every slot of the pool; the gather path is
    the faster there). Only the lean forward can, and on a GPU only where torch.compile has triton to build the
    kernel with: auto steps aside, flex is a ConfigError."""
    if mode == "flex" and not mirrored(model):
        raise ConfigError(
            f"inference.paged_attention=flex reads the KV pool in retrain's own forward, which "
            f"{model.config.model_type} does not run (it mirrors {', '.join(MIRRORED)}); use paged_attention=gather"
        )
    compiles = device.type != "cuda" or has_triton()
    if mode == "flex" and not compiles:
        raise ConfigError(
            "inference.paged_attention=flex compiles its kernel with triton on a GPU, which this environment lacks "
            "(pip install triton); use paged_attention=gather"
        )
    return mode == "flex" or (mode == "auto" and device.type == "cuda" and compiles)
