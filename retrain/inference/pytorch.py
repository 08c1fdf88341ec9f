"""In-process sampling on the very model object the backend trains (no second copy of the model).

Built from the run's tokenizer and the backend's EngineResources, whose `model` it samples with
(in split mode, `resources.overlap`, a copy of it on the inference device, kept current by `sync`).

One prefill per prompt, whose KV cache is repeated G times; then all B×G rows are decoded together,
one token per forward. A row leaves the batch (and the cache) when it emits EOS, and the loop stops
when no row is left or max_tokens is reached.

Log-prob semantics: the recorded log-prob of a sampled token is log_softmax(logits / T) of the full
temperature-scaled distribution, before top-p truncation — the quantity the trainer recomputes, so
the first-update importance ratio is 1. The token itself is drawn from the top-p nucleus of that
distribution; the mean probability mass the nucleus kept is reported as `policy/top_p_mass`.
Temperature 0 is greedy (argmax); its log-probs and entropies are those of the T = 1 distribution.
Rollouts come back as CPU tensors whatever the device. An fp32 model's LoRA layers sample through
merged weights W + s·B·A (`merge_lora`, retrain/model/merged_lora.py): one matmul instead of three;
other plain LoRA layers (bf16/fp16) compute PEFT's ops without its per-call bookkeeping (`lean_lora`).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from peft import set_peft_model_state_dict
from peft.utils import load_peft_weights
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from retrain.errors import ConfigError
from retrain.inference.completions import stop_token_ids
from retrain.inference.config import PytorchEngineConfig
from retrain.model.attention_kernels import attending_with, attention_implementation
from retrain.model.lean_decoder import causal_lm_logits
from retrain.model.logprobs import left_pad, scaled_log_softmax
from retrain.model.merged_lora import lean_lora, merged_lora, plain_lora_layers
from retrain.model.probe import Probe, StaleWeightsError
from retrain.model.resources import EngineResources
from retrain.model.rows import positions_from_mask
from retrain.model.train_mode import set_training
from retrain.plugins import built_in
from retrain.types import Rollouts, SamplingParams, WeightUpdate

log = logging.getLogger(__name__)


@dataclass
class TokenChoice:
    """What the sampler picked at one decode step, for every active row."""

    tokens: torch.Tensor  # [R] long
    logprobs: torch.Tensor  # [R] float32, from the full temperature-scaled distribution
    kept_mass: torch.Tensor  # [R] float32, probability mass of the top-p nucleus (1 without top-p)
    entropies: torch.Tensor | None  # [R] float32


def choose_tokens(
    logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | None, with_entropy: bool
) -> TokenChoice:
    """Pick one token per row from [R, V] logits: argmax at T = 0, else top-p sampling."""
    logp = scaled_log_softmax(logits, sampling.temperature)
    rows = logp.shape[0]
    kept_mass = torch.ones(rows, device=logp.device)
    if sampling.temperature == 0:
        tokens = logp.argmax(dim=-1)
    elif sampling.top_p >= 1.0:
        tokens = draw(logp.exp(), generator)
    else:
        sorted_logp, order = logp.sort(dim=-1, descending=True)
        sorted_probs = sorted_logp.exp()
        # Keep a token while the mass strictly before it is below top_p: the top token always stays.
        in_nucleus = (sorted_probs.cumsum(dim=-1) - sorted_probs) < sampling.top_p
        nucleus = sorted_probs * in_nucleus
        kept_mass = nucleus.sum(dim=-1)
        tokens = order.gather(-1, draw(nucleus, generator).unsqueeze(-1)).squeeze(-1)
    entropies = -(logp.exp() * logp).sum(dim=-1) if with_entropy else None
    return TokenChoice(
        tokens=tokens,
        logprobs=logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1),
        kept_mass=kept_mass,
        entropies=entropies,
    )


def draw(weights: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One index per row of [R, V] non-negative `weights`, drawn with probability proportional to them.

    Inverse CDF with one uniform per row: torch.multinomial draws an exponential per entry, ~10x
    slower at a 260-token vocabulary (a few % of a tiny model's step). An index of weight 0 is never
    returned: should rounding in the running sum land a draw on one, the row takes its top weight.
    """
    cdf = weights.cumsum(dim=-1)
    uniform = torch.rand((weights.shape[0], 1), generator=generator, device=weights.device, dtype=cdf.dtype)
    drawn = torch.searchsorted(cdf, uniform * cdf[:, -1:], right=True).clamp_max_(weights.shape[-1] - 1)
    possible = weights.gather(-1, drawn).squeeze(-1) > 0
    return torch.where(possible, drawn.squeeze(-1), weights.argmax(dim=-1))


class Decoded(NamedTuple):
    """Per-row results of the decode loop, [N, max_tokens] on the engine's device."""

    ids: torch.Tensor
    mask: torch.Tensor
    logprobs: torch.Tensor
    entropies: torch.Tensor | None
    kept_mass: torch.Tensor
    finished: torch.Tensor  # [N] stopped at EOS


@built_in
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
        self.tokenizer = tokenizer
        self.device = torch.device(resources.device)
        self._attention = attention_implementation(config.attention_kernel, self.device, self.model.dtype)
        self.prefix_caching = config.prefix_caching
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
        self, prompt_ids: list[list[int]], group_size: int, sampling: SamplingParams, generator_seed: int | None
    ) -> Rollouts:
        _check_sampling(group_size, sampling)
        prompts, prompt_mask = left_pad(prompt_ids, self.pad_id, self.device)
        generator = None
        if generator_seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(generator_seed)
        set_training(self.model, False)  # no dropout; it stays so until the backend trains
        with torch.inference_mode(), self._serving():
            decoded = self._decode(prompts, prompt_mask, group_size, sampling, generator)
        ids, mask, logprobs, entropies, kept_mass, finished = decoded
        width = int(mask.sum(dim=1).max())
        completion_ids, completion_mask = _export(ids[:, :width]), _export(mask[:, :width])
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
            metrics={"policy/top_p_mass": float(kept_mass[mask].mean())} if sampling.temperature > 0 else {},
        )

    def _decode(
        self,
        prompts: torch.Tensor,
        prompt_mask: torch.Tensor,
        group_size: int,
        sampling: SamplingParams,
        generator: torch.Generator | None,
    ) -> Decoded:
        rows = prompts.shape[0] * group_size
        steps = sampling.max_tokens
        ids = torch.full((rows, steps), self.pad_id, dtype=torch.long, device=self.device)
        mask = torch.zeros((rows, steps), dtype=torch.bool, device=self.device)
        logprobs = torch.zeros((rows, steps), dtype=torch.float32, device=self.device)
        kept_mass = torch.ones((rows, steps), dtype=torch.float32, device=self.device)
        entropies = (
            torch.zeros((rows, steps), dtype=torch.float32, device=self.device) if sampling.return_entropies else None
        )
        finished = torch.zeros(rows, dtype=torch.bool, device=self.device)

        logits, cache, attention = self._prefill(prompts, prompt_mask, group_size, room=steps)
        active = torch.arange(rows, device=self.device)  # row index of each cache entry
        positions = prompt_mask.sum(dim=1).repeat_interleave(group_size)
        for step in range(steps):
            choice = choose_tokens(logits, sampling, generator, entropies is not None)
            ids[active, step] = choice.tokens
            mask[active, step] = True
            logprobs[active, step] = choice.logprobs
            kept_mass[active, step] = choice.kept_mass
            if entropies is not None and choice.entropies is not None:
                entropies[active, step] = choice.entropies
            done = torch.isin(choice.tokens, self.eos_ids)
            finished[active[done]] = True
            num_done = int(done.sum())  # the one host-device sync per step
            if step == steps - 1 or num_done == len(active):
                break
            tokens = choice.tokens
            if num_done:
                # Finished rows leave the batch so later steps only compute live rows.
                keep = (~done).nonzero().squeeze(-1)
                cache.batch_select_indices(keep)
                active, attention, positions, tokens = active[keep], attention[keep], positions[keep], tokens[keep]
            attention = torch.cat([attention, attention.new_ones((attention.shape[0], 1))], dim=1)
            next_logits = causal_lm_logits(self.model, tokens.unsqueeze(-1), attention, positions.unsqueeze(-1), cache)
            logits = next_logits[:, -1]
            positions = positions + 1
        return Decoded(ids, mask, logprobs, entropies, kept_mass, finished)

    def _prefill(
        self, prompts: torch.Tensor, prompt_mask: torch.Tensor, group_size: int, room: int
    ) -> tuple[torch.Tensor, DynamicCache, torch.Tensor]:
        """Run the prompts once and return (next-token logits, KV cache with `room` for decode steps, attention
        mask) for all B·G rows."""
        if not self.prefix_caching:
            prompts = prompts.repeat_interleave(group_size, dim=0)
            prompt_mask = prompt_mask.repeat_interleave(group_size, dim=0)
        cache = decode_cache(self.model.config, room)
        attention = prompt_mask.long()
        logits = causal_lm_logits(
            self.model, prompts, attention, positions_from_mask(prompt_mask), cache, logits_to_keep=1
        )[:, -1]
        if self.prefix_caching:
            cache.batch_repeat_interleave(group_size)
            logits = logits.repeat_interleave(group_size, dim=0)
            attention = attention.repeat_interleave(group_size, dim=0)
        return logits, cache, attention

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


class GrowingLayer(DynamicLayer):
    """A DynamicLayer whose keys and values sit at the front of buffers with `room` spare positions.

    DynamicLayer appends a decode step's key and value with torch.cat, copying the whole cache every
    step (~20% of sampling at 64 new tokens on CPU); here they are written into the spare room. Attention
    sees the same values (a view of the buffer instead of a fresh tensor), so the log-probs are bit-identical.
    A cache whose rows were selected or repeated (a new tensor) moves into a new buffer on the next step.
    """

    def __init__(self, room: int) -> None:
        super().__init__()
        self.room = room
        self.buffers: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys is None or self.values is None or self.keys.numel() == 0:  # the prefill
            return super().update(key_states, value_states, *args, **kwargs)
        length, added = self.keys.shape[-2], key_states.shape[-2]
        if self.buffers is None or not self._in_buffers(length + added):
            self.buffers = (_with_room(self.keys, added + self.room), _with_room(self.values, added + self.room))
        keys, values = self.buffers
        keys[:, :, length : length + added].copy_(key_states)
        values[:, :, length : length + added].copy_(value_states)
        self.keys, self.values = keys[:, :, : length + added], values[:, :, : length + added]
        return self.keys, self.values

    def _in_buffers(self, length: int) -> bool:
        """The cache is the front of the buffers (no rows selected since) and `length` positions fit in them."""
        if self.buffers is None or self.keys is None or self.values is None:
            return False
        keys, values = self.buffers
        return (
            self.keys.data_ptr() == keys.data_ptr()
            and self.values.data_ptr() == values.data_ptr()
            and self.keys.shape[0] == keys.shape[0]
            and length <= keys.shape[-2]
        )


def decode_cache(config: Any, room: int) -> DynamicCache:
    """The model's DynamicCache, its full-attention layers GrowingLayers with `room` positions to decode into."""
    cache = DynamicCache(config=config)
    cache.layers = [GrowingLayer(room) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def _with_room(tensor: torch.Tensor, room: int) -> torch.Tensor:
    """[B, H, L, D] copied to the front of a new [B, H, L + room, D] buffer."""
    batch, heads, length, dim = tensor.shape
    buffer = tensor.new_empty((batch, heads, length + room, dim))
    buffer[:, :, :length].copy_(tensor)
    return buffer


def _check_sampling(group_size: int, sampling: SamplingParams) -> None:
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if sampling.max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {sampling.max_tokens}")
    if sampling.temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {sampling.temperature}")
    if not 0 < sampling.top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {sampling.top_p}")


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
