"""The composable algorithm: episode advantage -> uncertainty -> token transforms -> batch steps.

One `compute` call turns a whole step (rewards [B, G]; log-probs, entropies, planning mask [N, T])
into token advantages [N, T]. Its parts are `_target_`s in conf/algorithm/; what it needs (planning
mask, entropies) and whether its advantages vary within a completion are derived from the parts.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from retrain.algorithm.advantages import groups_with_signal
from retrain.algorithm.base import AdvantageOutput
from retrain.algorithm.batch import AdvantageCap, BatchNormalization, nonzero_stats, stats_metrics
from retrain.algorithm.checks import ADVANTAGE_CHECKS, TRANSFORM_CHECKS, UNCERTAINTY_CHECKS, require
from retrain.algorithm.planning import PlanningDetector
from retrain.algorithm.sepa import SEPASchedule
from retrain.algorithm.tokens import Moments, TokenBatch, as_weights, capped, split_moments, weighted_moments
from retrain.algorithm.transforms import SurprisalMask
from retrain.algorithm.uncertainty import resolve_uncertainty
from retrain.plugins import built_in, check_finite, checked, declared, plugin_name

Transform = Callable[[TokenBatch], TokenBatch]


@built_in
class Algorithm:
    """An episode advantage, an uncertainty kind and an ordered dict of token transforms
    (satisfies retrain.algorithm.base.Algorithm).

    After the configured transforms come, when enabled, the surprisal mask, batch normalisation
    (`batch_advantage_norm`, or an advantage that declares `batch_normalized`) and the cap.
    `gtpo` and `hicra` are the hyper-parameter sections the preset's transforms read through
    interpolation; they are kept here only so `describe()` can show them. Parts that are not
    retrain's own are wrapped here, where they are composed, so their outputs are checked.
    """

    def __init__(
        self,
        name: str,
        label: str,
        advantage: Callable[[torch.Tensor], torch.Tensor],
        uncertainty: str = "surprisal",
        transforms: Mapping[str, Transform | None] | None = None,
        surprisal_mask_rho: float = 0.0,
        batch_advantage_norm: bool = False,
        adv_clip_max: float = 0.0,
        gtpo: Mapping[str, Any] | None = None,
        hicra: Mapping[str, Any] | None = None,
        sepa: SEPASchedule | None = None,
        planning: PlanningDetector | None = None,
    ) -> None:
        require(
            callable(advantage),
            f"algorithm.advantage must be a callable (rewards [B, G]) -> [B, G], "
            f"got {advantage!r}; name a function with `_target_` and `_partial_: true`",
        )
        require(surprisal_mask_rho >= 0.0, f"algorithm.surprisal_mask_rho={surprisal_mask_rho} must be >= 0")
        require(adv_clip_max >= 0.0, f"algorithm.adv_clip_max={adv_clip_max} must be >= 0")
        self.name = name
        self.label = label or name
        self.advantage = checked(advantage, ADVANTAGE_CHECKS, f"episode advantage {plugin_name(advantage)}")
        self.uncertainty = resolve_uncertainty(uncertainty)
        self._uncertainty_fn = checked(
            self.uncertainty.fn, UNCERTAINTY_CHECKS, f"uncertainty {self.uncertainty.name!r}"
        )
        self.stages: list[tuple[str, Transform]] = []
        for key, transform in (transforms or {}).items():
            if transform is None:  # `algorithm.transforms.hicra=null` switches a transform off
                continue
            require(
                callable(transform),
                f"algorithm.transforms.{key} must be a callable (TokenBatch) -> TokenBatch, got {transform!r}",
            )
            what = f"transform algorithm.transforms.{key} ({plugin_name(transform)})"
            self.stages.append((key, checked(transform, TRANSFORM_CHECKS, what)))
        if surprisal_mask_rho > 0.0:
            self.stages.append(("surprisal_mask", SurprisalMask(surprisal_mask_rho)))
        self.batch_normalized = batch_advantage_norm or bool(declared(advantage, "batch_normalized", False))
        if self.batch_normalized:
            self.stages.append(("batch_norm", BatchNormalization()))
        if adv_clip_max > 0.0:
            self.stages.append(("adv_cap", AdvantageCap(adv_clip_max)))
        self.hyperparameters = {"gtpo": dict(gtpo or {}), "hicra": dict(hicra or {})}
        self.sepa = sepa if sepa is not None else SEPASchedule()
        self.planning = planning if planning is not None else PlanningDetector()
        self._lambda = 0.0
        self._execution_variance: float | None = None

    # ---- what the parts need and do (derived, never configured) ------------------------------------
    @property
    def token_varying(self) -> bool:
        """Whether advantages can differ across a completion's tokens (undeclared plugins: yes)."""
        return any(declared(t, "token_varying", True) for _, t in self.stages)

    @property
    def needs_planning(self) -> bool:
        return any(declared(t, "needs_planning", False) for _, t in self.stages)

    @property
    def needs_entropies(self) -> bool:
        return self.uncertainty.needs_entropies

    @property
    def uses_sepa(self) -> bool:
        return any(declared(t, "uses_sepa_lambda", False) for _, t in self.stages)

    def describe(self) -> dict[str, Any]:
        """A JSON-able summary for `retrain explain`-style reports and preflight messages."""
        return {
            "name": self.name,
            "label": self.label,
            "advantage": plugin_name(self.advantage),
            "uncertainty": self.uncertainty.name,
            "transforms": {key: plugin_name(t) for key, t in self.stages},
            "token_varying": self.token_varying,
            "needs_planning": self.needs_planning,
            "needs_entropies": self.needs_entropies,
            "uses_sepa": self.uses_sepa,
            **self.hyperparameters,
        }

    # ---- the step ----------------------------------------------------------------------------------
    def begin_step(self, step: int) -> dict[str, float]:
        """Resolve this step's SEPA lambda before it samples (0 without a SEPA transform)."""
        self._lambda = self.sepa.lambda_at(step) if self.uses_sepa else 0.0
        self._execution_variance = None
        return {"sepa_lambda": self._lambda}

    def planning_mask(
        self, completion_ids: torch.Tensor, completion_mask: torch.Tensor, tokenizer: Any
    ) -> torch.Tensor:
        return self.planning.mask(completion_ids, completion_mask, tokenizer)

    def compute(
        self,
        rewards: torch.Tensor,
        logprobs: torch.Tensor,
        mask: torch.Tensor,
        entropies: torch.Tensor | None = None,
        planning: torch.Tensor | None = None,
    ) -> AdvantageOutput:
        """Token advantages for one step (see the module docstring for shapes)."""
        mask = mask.bool()
        self._check_inputs(rewards, logprobs, mask, entropies, planning)
        rewards = rewards.float()
        group_size = rewards.shape[1]
        has_signal = groups_with_signal(rewards) | self.batch_normalized
        episode = self.advantage(rewards).float() * has_signal.unsqueeze(1)
        mask_weights = as_weights(mask)
        raw = self._uncertainty_fn(logprobs, mask, entropies).float()
        zeroed = raw * mask_weights  # finite padding values vanish; a product is cheaper than a select
        if not bool(torch.isfinite(zeroed.sum(dim=1)).all()):  # NaN/inf: on padding (ignored) or real tokens
            zeroed = check_finite(torch.where(mask, raw, 0.0), what=f"uncertainty {self.uncertainty.name!r}")
        raw = capped(zeroed)  # every kind, plugins included, is capped at MAX_UNCERTAINTY
        if planning is not None:
            planning = planning.bool() & mask
        batch = TokenBatch(
            advantages=mask_weights * episode.reshape(-1, 1),
            uncertainty=raw,
            raw_uncertainty=raw,
            mask=mask,
            planning=planning,
            group_size=group_size,
            sepa_lambda=self._lambda,
            mask_weights=mask_weights,
        )
        before = split_moments(raw, batch)
        for _, transform in self.stages:
            batch = transform(batch)
        after = before if batch.uncertainty is raw else split_moments(batch.uncertainty, batch)
        if self.uses_sepa and self.sepa.schedule == "auto":  # one observation per step, used by end_step
            self._execution_variance = self._auto_observation(raw, batch, before[0])
        metrics = {**self._uncertainty_metrics(before, after), **batch.metrics}
        if "batch_adv_count" not in metrics:  # batch normalisation reports its own (pre-normalisation) stats
            metrics.update(stats_metrics(*nonzero_stats(batch.advantages)))
        return AdvantageOutput(batch.advantages, has_signal, metrics, episode)

    def end_step(self, correct_rate: float) -> None:
        """After the step: the correctness gate and the auto schedule learn for the next step."""
        if self.uses_sepa:
            self.sepa.update(correct_rate, self._execution_variance)
        self._execution_variance = None

    def state_dict(self) -> dict[str, Any]:
        return {"sepa": self.sepa.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        require("sepa" in state, f"algorithm state {sorted(state)} has no 'sepa' entry")
        self.sepa.load_state_dict(dict(state["sepa"]))

    # ---- helpers -----------------------------------------------------------------------------------
    def _check_inputs(
        self,
        rewards: torch.Tensor,
        logprobs: torch.Tensor,
        mask: torch.Tensor,
        entropies: torch.Tensor | None,
        planning: torch.Tensor | None,
    ) -> None:
        if rewards.dim() != 2:
            raise ValueError(f"rewards must be [B, G], got shape {list(rewards.shape)}")
        rows = rewards.shape[0] * rewards.shape[1]
        if mask.dim() != 2 or mask.shape[0] != rows:
            raise ValueError(f"mask must be [B*G={rows}, T], got shape {list(mask.shape)}")
        for label, tensor in (("logprobs", logprobs), ("entropies", entropies), ("planning", planning)):
            if tensor is not None and tensor.shape != mask.shape:
                raise ValueError(f"{label} has shape {list(tensor.shape)}, expected {list(mask.shape)} like the mask")
        if not bool(torch.isfinite(rewards).all()):
            raise ValueError(f"rewards contain non-finite values: {rewards.tolist()}")
        if planning is None and self.needs_planning:
            raise ValueError(
                f"algorithm '{self.name}' needs the planning mask: pass "
                "algorithm.planning_mask(completion_ids, completion_mask, tokenizer)"
            )

    @staticmethod
    def _auto_observation(raw: torch.Tensor, batch: TokenBatch, execution: Moments) -> float:
        """Variance of the step's non-negative execution-token uncertainties (the auto schedule's input)."""
        if bool((raw >= 0).all()):
            return execution.var
        return weighted_moments(raw, batch.execution_weights() * (raw >= 0)).var

    def _uncertainty_metrics(self, before: tuple[Moments, Moments], after: tuple[Moments, Moments]) -> dict[str, float]:
        """Execution/planning uncertainty before and after the transforms, SEPA's lambda and gate."""
        prefix = self.uncertainty.metric_prefix
        (exec_before, plan_before), (exec_after, plan_after) = before, after
        return {
            "sepa_lambda": self._lambda,
            "sepa_gate_open": float(self.uses_sepa and self.sepa.gate_open),
            "exec_entropy_mean": exec_before.mean,
            "exec_entropy_var": exec_before.var,
            "plan_entropy_mean": plan_before.mean,
            "plan_entropy_var": plan_before.var,
            f"{prefix}/exec_count": float(exec_before.count),
            f"{prefix}/plan_count": float(plan_before.count),
            f"{prefix}/exec_mean_before": exec_before.mean,
            f"{prefix}/exec_var_before": exec_before.var,
            f"{prefix}/plan_mean_before": plan_before.mean,
            f"{prefix}/plan_var_before": plan_before.var,
            f"{prefix}/exec_mean_after": exec_after.mean,
            f"{prefix}/exec_var_after": exec_after.var,
            f"{prefix}/plan_mean_after": plan_after.mean,
            f"{prefix}/plan_var_after": plan_after.var,
        }
