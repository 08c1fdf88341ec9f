"""backend=local: a Hugging Face causal LM with a PEFT LoRA adapter, trained with PyTorch here.

The inference engine is built beside it from `engine_resources()`, which include the live model
(the in-process engine therefore samples with the very weights it trains). Training computes the loss of docs/loss.md
(retrain/objective): the old log-probs are the sampler's, or the trainer's own (one no-grad forward per batch)
under a mismatch correction (`training.mismatch_mode`) or several optimizer steps per batch; new log-probs use
the sampler's temperature, the token losses are aggregated over each optimizer step's (mini-)batch
(`training.loss_agg`, exact across micro-batches and ranks), `updates_per_batch` × `mini_batches` AdamW steps
per `train` at the LR schedule's rate, and a non-finite loss or gradient skips that step without touching the
adapter. A batch's WeightUpdate names the adapter's live parameters; its version counts the batches that
took at least one optimizer step.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from peft import set_peft_model_state_dict
from peft.utils import load_peft_weights

from retrain.backend.base import Capabilities
from retrain.backend.config import LocalBackendConfig, auto_switch
from retrain.backend.devices import resolve_devices
from retrain.backend.lr_schedule import lr_scheduler
from retrain.backend.micro_batches import row_micro_batches
from retrain.backend.settings import LossSettings, OptimSettings
from retrain.distributed.gradients import all_reduce_gradients
from retrain.distributed.world import all_max, all_sum
from retrain.errors import ConfigError
from retrain.model.document_packing import trains_with_documents
from retrain.model.fused_elementwise import fuses_elementwise, mark_fused
from retrain.model.lean_decoder import causal_lm_of
from retrain.model.logprobs import ForwardTokens, completion_logprobs, completion_logprobs_and_entropy
from retrain.model.merged_lora import lean_lora, plain_lora_layers
from retrain.model.peft_files import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from retrain.model.probe import Probe, probe_tolerance
from retrain.model.resources import EngineResources
from retrain.model.spec import ModelSpec
from retrain.model.train_mode import set_training
from retrain.objective.aggregation import aggregation
from retrain.objective.mismatch import correction, log_weights, mismatch_sums
from retrain.objective.policy import TokenLoss, policy_token_loss
from retrain.objective.support import ALL_KEYS
from retrain.plugins import built_in
from retrain.settings_object import takes_settings
from retrain.types import Rollouts, TrainBatch, TrainResult, WeightUpdate

log = logging.getLogger(__name__)

OPTIMIZER_FILE = "optimizer.pt"  # the optimizer moments: without them a resume is not exact
SCHEDULER_FILE = "scheduler.pt"  # the LR schedule's state (absent from checkpoints older than schedules: constant)


@built_in
@takes_settings(LocalBackendConfig)
class LocalBackend:
    """Satisfies retrain.backend.base.Backend; see the module docstring."""

    capabilities = Capabilities(
        reports_sync_loss=True,
        preserves_token_advantages=True,
        supports_checkpoint_resume=True,
        resume_runtime_dependent=False,
        returns_entropies=True,
    )
    checkpoint_files = (ADAPTER_CONFIG, ADAPTER_WEIGHTS, OPTIMIZER_FILE)
    kl_to_base = True  # training.kl_coef: the base model is this model with its adapter disabled
    objective_keys = (
        ALL_KEYS  # every objective, aggregation, entropy bonus, LR schedule, correction (retrain/objective)
    )
    data_parallel = True  # trains its share of a step's rows on each rank of a torch.distributed run

    def __init__(
        self, config: LocalBackendConfig, model: ModelSpec, optim: OptimSettings, loss: LossSettings, seed: int
    ) -> None:
        self.spec = model
        self.devices = resolve_devices(config.devices)
        self.device = self.devices.training
        self.micro_batch_tokens = config.micro_batch_tokens
        self.loss_settings = loss
        self.optim_settings = optim
        log.info("Loading train model: %s on %s...", model.name_or_path, self.device)
        self.model = model.load_lora_model(self.device, seed)
        # `auto` is resolved from the memory plan by the composition root; a backend built without one trains without
        if auto_switch(config.gradient_checkpointing) == "true":
            enable_activation_checkpointing(self.model)
        self.documents = trains_with_documents(config.train_attention, self.model, self.device)
        mark_fused(causal_lm_of(self.model), fuses_elementwise(auto_switch(config.fused_elementwise), self.device))
        self.forward_tokens = ForwardTokens()  # the step's, for train/padding_frac
        self.adapter = {name: p for name, p in self.model.named_parameters() if p.requires_grad}
        self.trainable = list(self.adapter.values())
        self.optimizer = torch.optim.AdamW(
            self.trainable,
            lr=optim.lr,
            betas=(optim.betas[0], optim.betas[1]),
            eps=optim.eps,
            weight_decay=optim.weight_decay,
            foreach=True,  # torch picks it on CUDA only; on CPU it is as exact (bit-identical) and ~1/3 cheaper
        )
        self.scheduler = lr_scheduler(self.optimizer, optim)
        self.plain_lora_layers = plain_lora_layers(self.model)  # trained through merged_lora.lean_lora
        self.weights_version = 0
        self.probe_tolerance = probe_tolerance(self.model.dtype)
        log.info(self.trainable_parameters)
        log.info("LocalBackend ready (device=%s, dtype=%s).", self.device, str(self.model.dtype).removeprefix("torch."))

    @property
    def trainable_parameters(self) -> str:
        trainable, total = self.model.get_nb_trainable_parameters()
        return (
            f"trainable params: {trainable:,d} || all params: {total:,d} || trainable%: {100 * trainable / total:.4f}"
        )

    def engine_resources(self) -> EngineResources:
        plan = self.devices
        return EngineResources(spec=self.spec, device=plan.inference, model=self.model, overlap=plan.split)

    def train(self, batch: TrainBatch) -> TrainResult:
        if batch.rollouts.temperature <= 0:
            raise ValueError("greedy rollouts (temperature 0) have no sampling distribution to train on")
        rollouts = _on_device(batch.rollouts, self.device)
        advantages = batch.advantages.to(self.device)
        row_mask = batch.row_mask.to(self.device)
        # Tokens with advantage exactly 0 carry no gradient: they leave the loss and its normaliser.
        # Only the policy's own tokens train: a multi-turn environment's turns are context (Rollouts.trained_mask).
        contributing = rollouts.trained_mask & (advantages != 0) & row_mask.unsqueeze(1)
        # data-parallel: each rank trains the rows its row_mask keeps; the loss's normaliser is the whole step's
        num_tokens = int(all_sum(contributing.sum()))
        if num_tokens == 0:
            return TrainResult(loss=0.0, grad_norm=0.0, skipped_nonfinite=False, num_tokens=0)
        settings = self.loss_settings
        rows = contributing.any(dim=1).nonzero().squeeze(-1)
        set_training(self.model, True)  # the engine leaves the shared model in eval mode
        lr = self.optimizer.param_groups[0]["lr"]  # the batch's first step's, from the schedule
        sums = _StepSums()
        metrics: dict[str, float] = {}
        self.forward_tokens = ForwardTokens()
        # the base model's log-probs first, through PEFT's own forward (which honours the disabled adapter)
        base = self._no_grad_logprobs(rollouts, rows, adapter=False) if settings.kl_coef > 0 else None
        with lean_lora(self.plain_lora_layers):  # routed once per batch, for every micro-batch
            old = rollouts.logprobs
            if self._recomputes_old:  # π_old: the trainer's own log-probs at the rollout's weights, once per batch
                old = self._no_grad_logprobs(rollouts, rows, adapter=True)
                metrics.update(self._mismatch_metrics(rollouts.logprobs, old, contributing))
            factor = None
            if settings.corrects_mismatch:
                log_w = log_weights(rollouts.logprobs, old, contributing, settings.mismatch_level)
                factor = correction(log_w, settings)
            for _ in range(self.optim_settings.updates_per_batch):
                for part in self._mini_batches(rollouts, contributing):
                    self._optimizer_step(rollouts, advantages, old, base, factor, part, sums, metrics)
        gap = (
            sums.logprob_gap
            if old is rollouts.logprobs
            else float(all_sum((old - rollouts.logprobs)[contributing].abs().sum()))
        )
        metrics.update(
            {
                "policy/ratio_mean": sums.ratio / max(1, sums.tokens),
                "policy/ratio_max": sums.ratio_max,
                "policy/clip_frac": sums.clipped / max(1, sums.tokens),
                # mean |trainer − sampler| log-prob of the trained tokens before the update: ~0 for a fresh engine
                "engine/logprob_abs_diff": gap / num_tokens,
                # mean k3 KL to the base model over the trained tokens, over the batch's updates
                **({"policy/kl": sums.kl / max(1, sums.tokens)} if base is not None else {}),
                # mean entropy of the trained tokens' distributions, over the batch's updates
                **({"policy/entropy": sums.entropy / max(1, sums.tokens)} if settings.entropy_coef > 0 else {}),
                **({"optim/lr": lr} if self._scheduled else {}),
                **({"optim/steps": float(sums.steps)} if self.optim_settings.steps_per_batch > 1 else {}),
                "train/padding_frac": self._padding_frac(),
            }
        )
        update = None
        if sums.taken:
            self.weights_version += 1
            update = WeightUpdate(version=self.weights_version, tensors=self.adapter)
        return TrainResult(
            loss=sums.loss / max(1, sums.steps),
            grad_norm=sums.grad_norm / max(1, sums.steps),
            skipped_nonfinite=sums.skipped > 0,
            num_tokens=num_tokens,
            metrics=metrics,
            update=update,
        )

    def _optimizer_step(
        self,
        rollouts: Rollouts,
        advantages: torch.Tensor,
        old: torch.Tensor,
        base: torch.Tensor | None,
        factor: torch.Tensor | None,
        contributing: torch.Tensor,
        sums: _StepSums,
        metrics: dict[str, float],
    ) -> None:
        """One optimizer step on the trained tokens `contributing` (a mini-batch's), its loss aggregated over them
        alone; adds its sums to `sums`. A non-finite loss or gradient skips the step without touching the adapter."""
        num_tokens = int(all_sum(contributing.sum()))
        if num_tokens == 0:  # an empty mini-batch (on every rank: the count is the step's)
            return
        weights, divisor = self._aggregation(contributing, num_tokens)
        if factor is not None:
            weights = weights * factor
        rows = contributing.any(dim=1).nonzero().squeeze(-1)
        self.optimizer.zero_grad(set_to_none=True)
        loss_total = 0.0
        ratio_sum, ratio_max, clipped, logprob_gap, kl_sum, entropy_sum = 0.0, -math.inf, 0.0, 0.0, 0.0, 0.0
        for micro_batch in row_micro_batches(rollouts, rows, self.micro_batch_tokens):
            token_loss, mask = self._micro_batch_loss(rollouts, advantages, old, base, contributing, micro_batch)
            micro_loss = (token_loss.loss * weights[micro_batch, : mask.shape[1]]).sum() / divisor
            micro_loss.backward()
            loss_total += float(micro_loss.detach())
            ratio_sum += float(token_loss.ratio[mask].sum())
            ratio_max = max(ratio_max, float(token_loss.ratio[mask].max()))
            clipped += float(token_loss.clipped[mask].sum())
            logprob_gap += float(token_loss.token_ratio[mask].log().abs().sum())
            if token_loss.kl is not None:
                kl_sum += float(token_loss.kl[mask].sum())
            if token_loss.entropy is not None:
                entropy_sum += float(token_loss.entropy[mask].sum())
        reduced = all_sum(
            torch.tensor([loss_total, ratio_sum, clipped, logprob_gap, kl_sum, entropy_sum], dtype=torch.float64)
        )
        loss_total, ratio_sum, clipped, logprob_gap, kl_sum, entropy_sum = (float(value) for value in reduced)
        ratio_max = float(all_max(torch.tensor(ratio_max, dtype=torch.float64)))

        metrics.update(all_reduce_gradients(self.trainable))  # every rank now holds the whole step's gradient
        grad_norm = self._clip_gradients()
        skipped = not (math.isfinite(loss_total) and math.isfinite(grad_norm))
        if skipped:
            log.warning("non-finite loss (%s) or grad norm (%s): optimizer step skipped", loss_total, grad_norm)
        else:
            self.optimizer.step()
            self.scheduler.step()  # the schedule counts optimizer steps
        self.optimizer.zero_grad(set_to_none=True)
        if sums.steps == 0:  # before any update of the batch: the trainer's current log-probs against the sampler's
            sums.logprob_gap = logprob_gap
        sums.add(loss_total, grad_norm, skipped, num_tokens, ratio_sum, ratio_max, clipped, kl_sum, entropy_sum)

    @property
    def _recomputes_old(self) -> bool:
        """Whether π_old is the trainer's own log-probs: for a mismatch correction, or for more than one optimizer
        step per batch (clipping against the policy that sampled, not the one a step ago)."""
        return self.loss_settings.corrects_mismatch or self.optim_settings.steps_per_batch > 1

    def _mini_batches(self, rollouts: Rollouts, contributing: torch.Tensor) -> list[torch.Tensor]:
        """The trained tokens of each of `training.mini_batches` mini-batches: the batch's groups split in order
        into that many runs of (nearly) equal size, the same on every rank."""
        if self.optim_settings.mini_batches == 1:
            return [contributing]
        groups = torch.arange(rollouts.num_rows, device=contributing.device) // rollouts.group_size
        chunks = torch.arange(int(groups.max()) + 1, device=contributing.device).tensor_split(
            self.optim_settings.mini_batches
        )
        return [contributing & torch.isin(groups, chunk).unsqueeze(1) for chunk in chunks]

    def _no_grad_logprobs(self, rollouts: Rollouts, rows: torch.Tensor, adapter: bool) -> torch.Tensor:
        """[N, T] log-probs of the chosen rows (0 elsewhere) before any update, micro-batch by micro-batch (the
        head chunked as in training): with the adapter as the engine samples (no dropout), or the base model."""
        out = torch.zeros_like(rollouts.logprobs)
        set_training(self.model, False)
        try:
            for micro_batch in row_micro_batches(rollouts, rows, self.micro_batch_tokens):
                with torch.no_grad(), contextlib.nullcontext() if adapter else self.model.disable_adapter():
                    values = self._rows_logprobs(rollouts, micro_batch)
                out[micro_batch, : values.shape[1]] = values
        finally:
            set_training(self.model, True)
        return out

    def _mismatch_metrics(
        self, sampler: torch.Tensor, trainer: torch.Tensor, trained: torch.Tensor
    ) -> dict[str, float]:
        """`mismatch/*`: the sampler–trainer gap over the batch's trained tokens, before any update."""
        settings = self.loss_settings
        local = mismatch_sums(sampler, trainer, trained, settings)
        count = float(all_sum(trained.sum()))
        total = all_sum(
            torch.tensor([local.kl, local.log_gap, local.ratio, local.truncated, local.masked], dtype=torch.float64)
        )
        kl, log_gap, ratio, truncated, masked = (float(value) / count for value in total)
        ratio_min = -float(all_max(torch.tensor(-local.ratio_min, dtype=torch.float64)))
        ratio_max = float(all_max(torch.tensor(local.ratio_max, dtype=torch.float64)))
        metrics = {
            "mismatch/kl": kl,
            "mismatch/logprob_diff": log_gap,
            "mismatch/ratio_mean": ratio,
            "mismatch/ratio_min": ratio_min,
            "mismatch/ratio_max": ratio_max,
        }
        if settings.mismatch_mode == "tis":
            metrics["mismatch/truncated_frac"] = truncated
        if settings.mismatch_mode == "mask":
            metrics["mismatch/masked_frac"] = masked
        return metrics

    def probe_logprobs(self, probe: Probe) -> torch.Tensor:
        set_training(self.model, False)  # as the engine samples: no dropout
        with torch.inference_mode(), lean_lora(self.plain_lora_layers):
            return probe.logprobs_under(self.model, self.device).cpu()

    @property
    def _scheduled(self) -> bool:
        """Whether the learning rate varies (then each step logs `optim/lr`)."""
        return self.optim_settings.lr_schedule != "constant" or self.optim_settings.warmup_steps > 0

    def _aggregation(self, contributing: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, float]:
        """Per-token weights and the step's divisor of `training.loss_agg` (retrain/objective/aggregation.py)."""
        settings = self.loss_settings
        if settings.loss_agg == "token_mean":  # the step's token count is known already
            return contributing, float(num_tokens)
        agg = aggregation(settings.loss_agg, contributing, settings.loss_agg_constant, all_sum)
        return agg.weights, agg.divisor

    def _micro_batch_loss(
        self,
        rollouts: Rollouts,
        advantages: torch.Tensor,
        old: torch.Tensor,
        base: torch.Tensor | None,
        contributing: torch.Tensor,
        rows: torch.Tensor,
    ) -> tuple[TokenLoss, torch.Tensor]:
        """Forward the chosen rows exactly as the sampler saw them (trimmed of all-padding columns); `old` and
        `base` are [N, T] log-probs of every row."""
        entropy = None
        if self.loss_settings.entropy_coef > 0:
            new_logprobs, entropy = self._rows_logprobs_and_entropy(rollouts, rows)
        else:
            new_logprobs = self._rows_logprobs(rollouts, rows)
        width = new_logprobs.shape[1]
        mask = contributing[rows, :width]
        token_loss = policy_token_loss(
            new_logprobs,
            old[rows, :width],
            advantages[rows, :width],
            self.loss_settings,
            None if base is None else base[rows, :width],
            mask,
            entropy,
        )
        return token_loss, mask

    def _rows_logprobs(self, rollouts: Rollouts, rows: torch.Tensor) -> torch.Tensor:
        """[len(rows), width] log-probs of the rows' completions at the sampler's temperature (width: the
        chosen rows' longest completion), their prompts trimmed of all-padding columns."""
        return completion_logprobs(*self._rows_inputs(rollouts, rows), **self._forward_layout)

    def _rows_logprobs_and_entropy(self, rollouts: Rollouts, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`_rows_logprobs` and each token's entropy, from the same chunks of logits."""
        return completion_logprobs_and_entropy(*self._rows_inputs(rollouts, rows), **self._forward_layout)

    @property
    def _forward_layout(self) -> dict[str, Any]:
        """completion_logprobs' layout arguments (how its forwards lay out the rows), and the step's token count."""
        return {"documents": self.documents, "tokens": self.forward_tokens}

    def _padding_frac(self) -> float:
        """The fraction of the step's training forwards' token positions (every rank's) that held padding."""
        tokens = self.forward_tokens
        computed, real = all_sum(torch.tensor([tokens.computed, float(tokens.real)], dtype=torch.float64)).tolist()
        return 1 - real / computed if computed else 0.0

    def _rows_inputs(
        self, rollouts: Rollouts, rows: torch.Tensor
    ) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float]:
        """completion_logprobs' arguments for the chosen rows, trimmed of all-padding columns."""
        prompts, prompt_index = (rows // rollouts.group_size).unique(return_inverse=True)
        prompt_mask = rollouts.prompt_mask[prompts]
        completion_mask = rollouts.completion_mask[rows]
        first = int(prompt_mask.any(dim=0).nonzero()[0])
        width = int(completion_mask.any(dim=0).nonzero()[-1]) + 1
        return (
            self.model,
            rollouts.prompt_ids[prompts, first:],
            prompt_mask[:, first:],
            prompt_index,
            rollouts.completion_ids[rows, :width],
            completion_mask[:, :width],
            rollouts.temperature,
        )

    def _clip_gradients(self) -> float:
        """Total gradient norm before clipping (clipping only when max_grad_norm > 0)."""
        if self.optim_settings.max_grad_norm > 0:
            return float(torch.nn.utils.clip_grad_norm_(self.trainable, self.optim_settings.max_grad_norm))
        return float(torch.nn.utils.get_total_norm([p.grad for p in self.trainable if p.grad is not None]))

    def save(self, path: Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(str(path))
        torch.save(self.optimizer.state_dict(), path / OPTIMIZER_FILE)
        torch.save(self.scheduler.state_dict(), path / SCHEDULER_FILE)

    def load(self, path: Path) -> WeightUpdate:
        path = Path(path)
        self._check_adapter_matches(path)
        weights = load_peft_weights(str(path), device=str(self.device))
        result: Any = set_peft_model_state_dict(self.model, weights)  # torch's (missing_keys, unexpected_keys)
        missing = [key for key in result.missing_keys if "lora_" in key]
        if result.unexpected_keys or missing:
            raise ConfigError(
                f"adapter in {path} does not fit this model: unexpected weights "
                f"{result.unexpected_keys[:5]}, missing LoRA weights {missing[:5]}"
            )
        # its moments are part of an exact resume: a checkpoint without them is damaged (rundir.Checkpoint.damage)
        self.optimizer.load_state_dict(torch.load(path / OPTIMIZER_FILE, map_location=self.device, weights_only=True))
        self.weights_version = _optimizer_steps(self.optimizer)
        if (path / SCHEDULER_FILE).exists():  # absent: saved before schedules existed, so at a constant rate
            self.scheduler.load_state_dict(torch.load(path / SCHEDULER_FILE, weights_only=True))
        return WeightUpdate(version=self.weights_version, tensors=self.adapter)

    def _check_adapter_matches(self, path: Path) -> None:
        config_file = path / ADAPTER_CONFIG
        if not config_file.exists():
            raise FileNotFoundError(f"no PEFT adapter in {path} (missing {ADAPTER_CONFIG})")
        saved = json.loads(config_file.read_text())
        expected = {"r": self.spec.lora_rank, "lora_alpha": self.spec.effective_alpha}
        mismatched = {key: (saved.get(key), value) for key, value in expected.items() if saved.get(key) != value}
        if mismatched:
            details = ", ".join(f"{key}: checkpoint {old} vs config {new}" for key, (old, new) in mismatched.items())
            raise ConfigError(f"adapter in {path} does not match model.lora_rank/lora_alpha ({details})")
        trained_on = saved.get("target_modules")
        if isinstance(trained_on, list) and set(trained_on) != set(self.spec.target_modules):
            raise ConfigError(
                f"adapter in {path} was trained on model.target_modules={sorted(trained_on)}, this run adapts "
                f"{sorted(self.spec.target_modules)}: set model.target_modules to the checkpoint's to resume it"
            )

    def close(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _optimizer_steps(optimizer: torch.optim.Optimizer) -> int:
    """Optimizer steps taken, as AdamW counts them (every step updates every adapter weight)."""
    return max((int(state["step"]) for state in optimizer.state.values() if "step" in state), default=0)


def _on_device(rollouts: Rollouts, device: torch.device) -> Rollouts:
    """The tensors training reads, moved to the training device once per step."""
    return replace(
        rollouts,
        prompt_ids=rollouts.prompt_ids.to(device),
        prompt_mask=rollouts.prompt_mask.to(device),
        completion_ids=rollouts.completion_ids.to(device),
        completion_mask=rollouts.completion_mask.to(device),
        logprobs=rollouts.logprobs.to(device),
        sampled_mask=None if rollouts.sampled_mask is None else rollouts.sampled_mask.to(device),
    )


def enable_activation_checkpointing(model: Any) -> None:
    """Recompute activations in backward, through the switch the installed transformers has: a release that has
    `activation_checkpointing_enable` warns (FutureWarning) that `gradient_checkpointing_enable` changes in v6;
    older 5.x releases have only the latter."""
    options = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=options)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)


@dataclass
class _StepSums:
    """A batch's optimizer steps, summed for its metrics (loss and grad norm: means over the steps taken or
    skipped; ratio, clip, KL, entropy: over every step's trained tokens)."""

    steps: int = 0
    skipped: int = 0
    loss: float = 0.0
    grad_norm: float = 0.0
    tokens: int = 0
    ratio: float = 0.0
    ratio_max: float = -math.inf
    clipped: float = 0.0
    kl: float = 0.0
    entropy: float = 0.0
    logprob_gap: float = 0.0  # Σ |trainer − sampler| of the first step's tokens, before it updates

    @property
    def taken(self) -> bool:
        return self.steps > self.skipped

    def add(
        self,
        loss: float,
        grad_norm: float,
        skipped: bool,
        tokens: int,
        ratio: float,
        ratio_max: float,
        clipped: float,
        kl: float,
        entropy: float,
    ) -> None:
        self.steps += 1
        self.skipped += int(skipped)
        self.loss += loss
        self.grad_norm += grad_norm
        self.tokens += tokens
        self.ratio += ratio
        self.ratio_max = max(self.ratio_max, ratio_max)
        self.clipped += clipped
        self.kl += kl
        self.entropy += entropy
