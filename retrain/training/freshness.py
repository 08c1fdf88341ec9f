"""The freshness proof: after every sync, the engine must score a fixed probe as the trainer does.

The probe is a short fixed text split into a prompt and a continuation. The engine scores the
continuation through the weights it samples with (a remote engine: its own serving path), the backend
through its own weights, both at T = 1. An engine still serving older weights (an adapter never
reloaded, a stale cache) scores it differently, and the run stops with StaleWeightsError instead of
training on off-policy rollouts. Scoring uses no randomness, so the proof never shifts a run's random
streams.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from retrain.backend.base import Backend
from retrain.inference.base import InferenceEngine
from retrain.model.probe import Probe, StaleWeightsError


@dataclass(frozen=True)
class Freshness:
    """One sync's proof: mean |Δ log-prob| on the probe between the engine and the trainer."""

    gap: float  # engine vs the trainer under the new weights
    gap_old: float | None  # engine vs the trainer under the weights before the update (None: unknown)
    shift: float | None  # the trainer's new vs old weights: how far the update moved the probe

    def metrics(self) -> dict[str, float]:
        known = {"gap": self.gap, "gap_old": self.gap_old, "shift": self.shift}
        return {f"engine/probe_{key}": value for key, value in known.items() if value is not None}


class FreshnessProof:
    """Proves after every sync that the engine serves the new weights, not the old ones.

    Two tests, both must pass. The engine's log-probs must be within the backend's tolerance of the
    trainer's under the new weights. And when the update moved the probe clearly beyond the numeric
    noise between the two paths (`SEPARATION` × the largest gap seen on fresh syncs), the engine must
    be far closer to the new weights than to the old ones (gap × FAR_CLOSER <= gap_old): an engine
    still serving the old weights then fails even when the update was smaller than the tolerance.
    A fresh engine fails that test only if its gap grew past ~6× the largest gap seen before (the
    triangle inequality gives gap_old >= shift − gap); updates too small to separate are left to the
    tolerance test, which a stale engine fails once the weights have drifted far enough.
    The trainer's probe log-probs of each version are kept, so the old side costs no extra forward.
    """

    SEPARATION = 32.0
    FAR_CLOSER = 4.0
    NOISE_FLOOR = 1e-6  # the smallest engine-vs-trainer noise assumed (identical paths give ~0)

    def __init__(self, probe: Probe, backend: Backend) -> None:
        self.probe = probe
        self.backend = backend
        self.trained: torch.Tensor | None = None  # the trainer's probe log-probs of the served version
        self.noise = self.NOISE_FLOOR

    def forget(self) -> None:
        """The trainer's weights were replaced (a checkpoint loaded): the old side is unknown."""
        self.trained = None

    def check(self, engine: InferenceEngine, version: int) -> Freshness:
        """Compare the engine with the trainer; StaleWeightsError naming the version when it is stale."""
        served = engine.probe_logprobs(self.probe).float().cpu()
        trained = self.backend.probe_logprobs(self.probe).float().cpu()
        old, self.trained = self.trained, trained
        gap = float((served - trained).abs().mean())
        result = Freshness(gap=gap, gap_old=None, shift=None)
        if old is not None:
            result = Freshness(
                gap=gap, gap_old=float((served - old).abs().mean()), shift=float((trained - old).abs().mean())
            )
        # An engine serving in a coarser precision than the trainer's (vLLM's inference.dtype=bf16 under an
        # fp32 backend) names its own tolerance; the proof holds it to the looser of the two.
        tolerance = max(self.backend.probe_tolerance, getattr(engine, "probe_tolerance", 0.0))
        if not gap <= tolerance:
            raise StaleWeightsError(
                f"the inference engine serves stale weights: after the sync to weights version {version}, "
                f"its log-probs on the probe differ from the trainer's by {gap:.3g} (tolerance {tolerance})"
            )
        separable = result.shift is not None and result.shift > self.SEPARATION * self.noise
        if separable and result.gap_old is not None and not gap * self.FAR_CLOSER <= result.gap_old:
            raise StaleWeightsError(
                f"the inference engine serves stale weights: after the sync to weights version {version}, "
                f"its log-probs on the probe are {result.gap_old:.3g} from the previous weights' and "
                f"{gap:.3g} from the new weights' (the update moved them by {result.shift:.3g})"
            )
        self.noise = max(self.noise, gap)
        return result
