"""Back-pressure: adapt the batch size to measured throughput with the Universal Scalability Law.

The rules and their constants, for users: docs/backpressure.md.

The step's concurrency is p = batch_size · group_size completions. Throughput follows the USL,
X(p) = λ·C(p) with C(p) = p / (1 + σ(p−1) + κ·p(p−1)): σ is contention (serial work), κ coherency
(cross-talk), so past p* = sqrt((1−σ)/κ) a bigger batch makes the step slower per token. The
controller sweeps batch sizes during warmup, fits σ, κ, λ to the (p, tokens/s) it measured, and then
throttles the batch size when p runs past p*, or grows it when p is well below p*, with a gap between
the two thresholds so it does not flap. The roofline hint (ours) only reports; it never acts.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from retrain.config import BackpressureConfig

log = logging.getLogger(__name__)

PREFIX = "train/backpressure/"
WINDOW = 100  # (p, tokens/s) pairs the fit uses: the most recent ones
MIN_FIT_CONCURRENCIES = 3  # a quadratic needs three distinct p
MEMORY_BOUND_RATIO = 1.1  # EMA throughput above the fitted curve by this much: memory_bound
RETROGRADE_RATIO = 0.8  # below it by this much: retrograde
FLOPS_PER_TOKEN_PER_PARAMETER = 6  # 2 to sample a token, about 4 to train on it (forward and backward)


def usl_throughput(p: float, sigma: float, kappa: float) -> float:
    """Relative capacity C(p) = p / (1 + σ(p−1) + κ·p(p−1)); throughput is λ·C(p)."""
    return p / (1.0 + sigma * (p - 1.0) + kappa * p * (p - 1.0))


def optimal_concurrency(sigma: float, kappa: float) -> float:
    """p* = sqrt((1−σ)/κ), where C(p) peaks; 1 when there is no peak (κ <= 0) or nothing scales (σ >= 1)."""
    if kappa <= 0 or sigma >= 1:
        return 1.0
    return math.sqrt((1.0 - sigma) / kappa)


def fit_usl(points: Iterable[tuple[float, float]]) -> dict[str, float]:
    """σ, κ, λ of the USL curve through (p, throughput) points, by least squares on p/x = A + B·p + C·p².

    p/X(p) = (1−σ)/λ + (σ−κ)/λ·p + κ/λ·p², so A+B+C = 1/λ, σ = (B+C)/(A+B+C), κ = C/(A+B+C); σ is
    clamped to [0, 1] and κ to >= 0. Points that describe no throughput curve (A+B+C <= 0) give λ = 0,
    which the controller reads as "no fit". ValueError with fewer than three distinct p, or a
    non-positive throughput.
    """
    pairs = [(float(p), float(x)) for p, x in points]
    if len({p for p, _ in pairs}) < MIN_FIT_CONCURRENCIES:
        raise ValueError(f"fit_usl needs points at >= {MIN_FIT_CONCURRENCIES} distinct concurrencies, got {pairs}")
    if any(not x > 0 or not math.isfinite(x) for _, x in pairs):
        raise ValueError(f"fit_usl needs positive finite throughputs, got {pairs}")
    p = np.array([pair[0] for pair in pairs])
    y = p / np.array([pair[1] for pair in pairs])
    scale = p.max()  # fit in p/scale: the columns 1, p, p² then have comparable magnitudes
    design = np.stack([np.ones_like(p), p / scale, (p / scale) ** 2], axis=1)
    (a, b, c), *_ = np.linalg.lstsq(design, y, rcond=None)
    b, c = b / scale, c / scale**2
    total = float(a + b + c)
    if not (total > 0 and math.isfinite(total)):
        return {"sigma": 0.0, "kappa": 0.0, "lam": 0.0}
    return {
        "sigma": min(max(float(b + c) / total, 0.0), 1.0),
        "kappa": max(0.0, float(c) / total),
        "lam": 1.0 / total,
    }


def fit_error(fit: Mapping[str, float], points: Iterable[tuple[float, float]]) -> float:
    """fit_usl's objective: the sum of squared errors of p/X against the fit's p/(λ·C(p)); infinite without λ > 0."""
    if not fit["lam"] > 0:
        return math.inf
    return sum((p / x - p / (fit["lam"] * usl_throughput(p, fit["sigma"], fit["kappa"]))) ** 2 for p, x in points)


def better_fit(refit: Mapping[str, float], fit: Mapping[str, float], points: Iterable[tuple[float, float]]) -> bool:
    """Whether a refit should replace the last fit: it describes a curve (λ > 0) and explains the points no worse.

    An unclamped refit is the least-squares optimum, so it always wins; one whose σ, κ were clamped
    after one slow step (or that gives λ = 0) can describe nothing the points say, and keeping the last
    fit then lets the controller see that step as retrograde.
    """
    pairs = list(points)
    return fit_error(refit, pairs) <= fit_error(fit, pairs)


def warmup_batch_sizes(min_batch: int, max_batch: int) -> list[int]:
    """The warmup sweep: min_batch, doubling while <= max_batch, then max_batch itself (1, 2, 4, ..., 64)."""
    if not 1 <= min_batch <= max_batch:
        raise ValueError(f"warmup_batch_sizes needs 1 <= min_batch <= max_batch, got {min_batch}, {max_batch}")
    sizes = [min_batch]
    while sizes[-1] * 2 <= max_batch:
        sizes.append(sizes[-1] * 2)
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


@dataclass(frozen=True)
class Roofline:
    """The roofline hint (ours): how close the achieved FLOP/s and bytes/s come to the hardware's peaks.

    FLOP/s ≈ 6·N·tokens/s (N parameters). Bytes/s ≈ weight bytes · decode steps/s, where the p
    sequences of a step advance together, so decode steps/s ≈ tokens/s / p. Estimates: they tell
    which roof the run is nearer, not an exact utilisation.
    """

    peak_gflops: float
    peak_bw_gb_s: float
    parameters: int
    parameter_bytes: int

    def hint(self, tokens_per_s: float, concurrency: int) -> dict[str, Any]:
        metrics: dict[str, Any] = {}
        if self.peak_gflops > 0:
            flops = FLOPS_PER_TOKEN_PER_PARAMETER * self.parameters * tokens_per_s
            metrics["compute_utilization"] = flops / (self.peak_gflops * 1e9)
        if self.peak_bw_gb_s > 0:
            decode_steps_per_s = tokens_per_s / concurrency
            metrics["bandwidth_utilization"] = self.parameter_bytes * decode_steps_per_s / (self.peak_bw_gb_s * 1e9)
        if len(metrics) == 2:
            closer = metrics["bandwidth_utilization"] > metrics["compute_utilization"]
            metrics["roofline"] = "memory" if closer else "compute"
        return metrics


def model_footprint(model: Any) -> tuple[int, int]:
    """Parameters and their bytes of a torch module (the roofline hint's N and weight bytes)."""
    parameters = list(model.parameters())
    return sum(p.numel() for p in parameters), sum(p.numel() * p.element_size() for p in parameters)


class BackpressureController:
    """The batching part (retrain.training.batching.Batching) that adapts the batch size to throughput (docs/backpressure.md).

    Steps 0 .. warmup_steps−1 run the warmup sweep's sizes, cycling. After each step the controller
    records (p, tokens/s), refits the USL on the last 100 pairs, classifies the regime and acts:
    throttle or increase set the size it holds to clamp(⌊throttle_margin·p*/group_size⌋, min, max);
    hold keeps it. A refit that describes no curve (λ = 0) or explains the window worse than the last fit
    (clamped σ, κ after one slow step) keeps the last fit, so the slow step is judged against it. It starts holding `training.batch_size` (clamped). The throughput EMA restarts at
    each new concurrency, so it never mixes throughputs of different batch sizes.
    """

    def __init__(
        self, settings: BackpressureConfig, batch_size: int, group_size: int, roofline: Roofline | None = None
    ) -> None:
        self.settings = settings
        self.group_size = group_size
        self.roofline = roofline
        self.sweep = warmup_batch_sizes(settings.min_batch_size, settings.max_batch_size)
        self.size = self._clamp(batch_size)
        if self.size != batch_size:
            log.info(
                "training.batch_size=%d is outside backpressure.min_batch_size..max_batch_size; starting at %d",
                batch_size,
                self.size,
            )
        if len(set(self.sweep[: settings.warmup_steps])) < MIN_FIT_CONCURRENCIES:
            log.warning(
                "backpressure: the warmup sweep (%s over %d steps) has fewer than %d batch sizes, so the USL "
                "cannot be fitted and the batch size stays %d; raise backpressure.warmup_steps or widen "
                "min_batch_size..max_batch_size",
                self.sweep,
                settings.warmup_steps,
                MIN_FIT_CONCURRENCIES,
                self.size,
            )
        self.window: deque[tuple[int, float]] = deque(maxlen=WINDOW)
        self.ema: float | None = None
        self.ema_concurrency: int | None = None
        self.fit: dict[str, float] | None = None

    def batch_size(self, step: int) -> int:
        if step < self.settings.warmup_steps:
            return self.sweep[step % len(self.sweep)]
        return self.size

    def observe(self, record: Mapping[str, Any]) -> dict[str, Any]:
        """Measure the step, refit, decide the size it holds; returns the step's `train/backpressure/...` metrics."""
        step = int(record["step"])
        concurrency = int(record["batch_size"]) * int(record["group_size"])
        tokens = float(record["mean_completion_tokens"]) * concurrency  # every completion sampled this step
        seconds = float(record["step_time_s"])
        metrics: dict[str, Any] = {"concurrency": concurrency}
        throughput = tokens / seconds if seconds > 0 else 0.0
        if throughput > 0 and math.isfinite(throughput):
            self._measure(concurrency, throughput)
            metrics["throughput_tok_s"] = throughput
            if self.roofline is not None:
                metrics.update(self.roofline.hint(throughput, concurrency))
        if self.ema is not None:
            metrics["ema_throughput_tok_s"] = self.ema
        regime, action = self._decide(step, concurrency, metrics)
        metrics.update(regime=regime, action=action, next_batch_size=self.batch_size(step + 1))
        return {PREFIX + key: value for key, value in metrics.items()}

    def _measure(self, concurrency: int, throughput: float) -> None:
        self.window.append((concurrency, throughput))
        if self.ema is None or self.ema_concurrency != concurrency:
            self.ema = throughput
        else:
            decay = self.settings.ema_decay
            self.ema = decay * self.ema + (1.0 - decay) * throughput
        self.ema_concurrency = concurrency
        if len({p for p, _ in self.window}) >= MIN_FIT_CONCURRENCIES:
            refit = fit_usl(self.window)
            if self.fit is None or better_fit(refit, self.fit, self.window):
                self.fit = refit  # else the last good fit stands: one slow step must not erase it

    def _decide(self, step: int, concurrency: int, metrics: dict[str, Any]) -> tuple[str, str]:
        """The step's regime and the action taken on the size the controller holds (docs/backpressure.md)."""
        if step < self.settings.warmup_steps:
            return "warmup", "sweep"
        fit = self.fit
        if fit is None or fit["lam"] <= 0:
            return "unfitted", "hold"
        settings = self.settings
        p_star = optimal_concurrency(fit["sigma"], fit["kappa"])
        metrics.update(fit, optimal_concurrency=p_star)
        regime = "optimal"
        if fit["kappa"] > 0 and concurrency > settings.throttle_margin * p_star and p_star > 1:
            regime = "retrograde"
        elif self.ema is not None and self.ema_concurrency == concurrency:
            ratio = self.ema / (fit["lam"] * usl_throughput(concurrency, fit["sigma"], fit["kappa"]))
            metrics["throughput_vs_model"] = ratio
            if ratio > MEMORY_BOUND_RATIO:
                regime = "memory_bound"
            elif ratio < RETROGRADE_RATIO:
                regime = "retrograde"
        if regime == "retrograde":
            action = "throttle"
        elif concurrency < settings.increase_margin * settings.throttle_margin * p_star:
            action = "increase"
        else:
            return regime, "hold"
        self.size = self._clamp(math.floor(settings.throttle_margin * p_star / self.group_size))
        return regime, action

    def _clamp(self, batch_size: int) -> int:
        return min(max(batch_size, self.settings.min_batch_size), self.settings.max_batch_size)

    def state_dict(self) -> dict[str, Any]:
        return {
            "batch_size": self.size,
            "backpressure": {
                "window": [list(pair) for pair in self.window],
                "ema": self.ema,
                "ema_concurrency": self.ema_concurrency,
                "fit": self.fit,
            },
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue exactly where the checkpoint's controller was; a checkpoint of a fixed-size run starts it fresh."""
        saved = state.get("backpressure")
        if saved is None:
            log.info("backpressure: the checkpoint's run had a fixed batch size; the controller starts fresh")
            return
        self.size = int(state["batch_size"])
        self.window = deque(((int(p), float(x)) for p, x in saved["window"]), maxlen=WINDOW)
        self.ema = None if saved["ema"] is None else float(saved["ema"])
        self.ema_concurrency = None if saved["ema_concurrency"] is None else int(saved["ema_concurrency"])
        self.fit = None if saved["fit"] is None else {k: float(v) for k, v in saved["fit"].items()}
