"""Back-pressure (docs/backpressure.md): the USL formulas, the fit, and the controller's decisions on scripted throughputs."""

from __future__ import annotations

import json
import logging
import math

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from retrain.config import BackpressureConfig, check_known_keys, compose
from retrain.errors import ConfigError
from retrain.run import config_identity
from retrain.training.backpressure import (
    BackpressureController,
    Roofline,
    better_fit,
    fit_usl,
    optimal_concurrency,
    usl_throughput,
    warmup_batch_sizes,
)
from retrain.training.batching import Batching, FixedBatching, build_batching

# a machine whose throughput follows the USL: p* = sqrt(0.95 / 0.002) ≈ 21.8 concurrent completions
SIGMA, KAPPA, LAM = 0.05, 0.002, 300.0
P_STAR = math.sqrt((1 - SIGMA) / KAPPA)
G = 4  # completions per prompt
TOKENS = 10.0  # mean completion tokens


def record(step: int, batch: int, speed: float = 1.0) -> dict:
    """A step's metrics record on the USL machine, its throughput scaled by `speed`."""
    p = batch * G
    throughput = speed * LAM * usl_throughput(p, SIGMA, KAPPA)
    return {
        "step": step,
        "batch_size": batch,
        "group_size": G,
        "mean_completion_tokens": TOKENS,
        "step_time_s": TOKENS * p / throughput,
    }


def controller(batch_size: int = 16, **settings: object) -> BackpressureController:
    return BackpressureController(BackpressureConfig(enabled=True, **settings), batch_size, G)  # type: ignore[arg-type]


def run_steps(bp: BackpressureController, steps: range, speed: float = 1.0) -> list[dict]:
    """Each step runs at the size the controller serves for it; returns the metrics it adds."""
    return [bp.observe(record(step, bp.batch_size(step), speed)) for step in steps]


# ---- the formulas -------------------------------------------------------------------------------
def test_usl_throughput_on_known_values() -> None:
    assert usl_throughput(1, 0.3, 0.1) == 1.0  # one unit of work: no contention, no cross-talk
    assert usl_throughput(8, 0.0, 0.0) == 8.0  # linear scaling
    assert usl_throughput(10, 0.1, 0.01) == pytest.approx(10 / (1 + 0.9 + 0.9))
    assert usl_throughput(4, 1.0, 0.0) == pytest.approx(1.0)  # fully serial: no speed-up


def test_optimal_concurrency_is_where_the_usl_peaks() -> None:
    assert optimal_concurrency(0.1, 0.01) == pytest.approx(math.sqrt(90))
    assert optimal_concurrency(0.2, 0.0) == optimal_concurrency(0.2, -1e-3) == optimal_concurrency(1.0, 0.01) == 1.0
    peak = optimal_concurrency(SIGMA, KAPPA)
    grid = [1 + i / 100 for i in range(20_000)]
    assert max(grid, key=lambda p: usl_throughput(p, SIGMA, KAPPA)) == pytest.approx(peak, abs=0.01)


def test_fit_recovers_a_synthetic_usl_curve() -> None:
    points = [(p, LAM * usl_throughput(p, SIGMA, KAPPA)) for p in [4, 8, 16, 32, 64, 128, 256]]
    fit = fit_usl(points)
    assert fit == pytest.approx({"sigma": SIGMA, "kappa": KAPPA, "lam": LAM}, rel=1e-6)


def test_fit_recovers_the_curve_through_measurement_noise() -> None:
    rng = np.random.default_rng(0)
    points = [
        (p, LAM * usl_throughput(p, SIGMA, KAPPA) * (1 + 0.01 * rng.standard_normal()))
        for p in [4, 8, 16, 32, 64, 128, 256] * 5
    ]
    fit = fit_usl(points)
    assert fit["sigma"] == pytest.approx(SIGMA, abs=0.01) and fit["lam"] == pytest.approx(LAM, rel=0.02)
    assert optimal_concurrency(fit["sigma"], fit["kappa"]) == pytest.approx(P_STAR, rel=0.05)


def test_fit_of_linear_scaling_finds_no_contention() -> None:
    fit = fit_usl([(p, 5.0 * p) for p in [1, 2, 4, 8]])
    assert fit["sigma"] == pytest.approx(0.0, abs=1e-9) and fit["kappa"] == pytest.approx(0.0, abs=1e-9)
    assert fit["lam"] == pytest.approx(5.0)


def test_fit_clamps_what_the_usl_cannot_hold() -> None:
    # throughput that improves faster than linearly: negative contention, clamped to 0
    fit = fit_usl([(p, p**1.5) for p in [1, 2, 4, 8]])
    assert fit["sigma"] == 0.0 and fit["kappa"] >= 0.0 and fit["lam"] > 0


def test_fit_needs_three_concurrencies_and_positive_throughputs() -> None:
    with pytest.raises(ValueError, match="3 distinct concurrencies"):
        fit_usl([(4, 10.0), (4, 11.0), (8, 15.0), (8, 16.0)])
    with pytest.raises(ValueError, match="positive finite throughputs"):
        fit_usl([(1, 1.0), (2, 0.0), (4, 3.0)])


def test_warmup_sweeps_powers_of_two_then_the_maximum() -> None:
    assert warmup_batch_sizes(1, 64) == [1, 2, 4, 8, 16, 32, 64]
    assert warmup_batch_sizes(1, 12) == [1, 2, 4, 8, 12]
    assert warmup_batch_sizes(3, 20) == [3, 6, 12, 20]
    assert warmup_batch_sizes(5, 5) == [5]
    with pytest.raises(ValueError):
        warmup_batch_sizes(8, 4)


# ---- the controller -----------------------------------------------------------------------------
def test_warmup_cycles_through_the_sweep_then_the_fit_throttles_an_oversized_batch() -> None:
    bp = controller(batch_size=16)  # p = 64, far past p* ≈ 21.8
    assert isinstance(bp, Batching)
    warmup = run_steps(bp, range(10))
    sizes = [1, 2, 4, 8, 16, 32, 64, 1, 2, 4]
    assert [m["train/backpressure/concurrency"] // G for m in warmup] == sizes
    assert {m["train/backpressure/regime"] for m in warmup} == {"warmup"}
    assert {m["train/backpressure/action"] for m in warmup} == {"sweep"}
    assert [m["train/backpressure/next_batch_size"] for m in warmup] == [*sizes[1:], 16]
    assert warmup[-1]["train/backpressure/concurrency"] == 16
    assert warmup[-1]["train/backpressure/throughput_tok_s"] == pytest.approx(LAM * usl_throughput(16, SIGMA, KAPPA))

    first = bp.observe(record(10, bp.batch_size(10)))  # the configured 16 prompts: p = 64
    assert first["train/backpressure/regime"] == "retrograde" and first["train/backpressure/action"] == "throttle"
    assert first["train/backpressure/optimal_concurrency"] == pytest.approx(P_STAR, rel=1e-6)
    throttled = math.floor(0.85 * P_STAR / G)  # 4 prompts: p = 16 <= 0.85·p*
    assert first["train/backpressure/next_batch_size"] == bp.batch_size(11) == throttled == 4


def test_hysteresis_holds_between_the_increase_and_throttle_thresholds() -> None:
    bp = controller(batch_size=16)
    after = run_steps(bp, range(40))[11:]  # throttled to 4 at step 10; p = 16 lies in [0.425·p*, 0.85·p*]
    assert {m["train/backpressure/action"] for m in after} == {"hold"}
    assert {m["train/backpressure/regime"] for m in after} == {"optimal"}
    assert {m["train/backpressure/concurrency"] // G for m in after} == {4}
    assert after[-1]["train/backpressure/throughput_vs_model"] == pytest.approx(1.0)


def test_a_batch_far_below_the_optimum_is_increased_once() -> None:
    bp = controller(batch_size=1)  # p = 4 < 0.5·0.85·p* ≈ 9.3
    metrics = run_steps(bp, range(14))
    assert metrics[10]["train/backpressure/action"] == "increase"
    assert [m["train/backpressure/concurrency"] // G for m in metrics[10:]] == [1, 4, 4, 4]
    assert [m["train/backpressure/action"] for m in metrics[11:]] == ["hold"] * 3


def test_throughput_above_the_curve_is_memory_bound_and_below_it_retrograde() -> None:
    # p = 12: neither past 0.85·p* nor below 0.425·p*; a concurrency the sweep did not run: the EMA starts here
    bp = controller(batch_size=3)
    run_steps(bp, range(10))
    above = bp.observe(record(10, 3, speed=1.5))
    assert above["train/backpressure/regime"] == "memory_bound" and above["train/backpressure/action"] == "hold"
    assert above["train/backpressure/throughput_vs_model"] > 1.1 and bp.batch_size(11) == 3
    bp = controller(batch_size=3)
    run_steps(bp, range(10))
    below = bp.observe(record(10, 3, speed=0.5))
    assert below["train/backpressure/regime"] == "retrograde" and below["train/backpressure/action"] == "throttle"
    assert below["train/backpressure/throughput_vs_model"] < 0.8
    assert bp.batch_size(11) == math.floor(0.85 * below["train/backpressure/optimal_concurrency"] / G)


def test_the_ema_smooths_throughput_at_one_concurrency_and_restarts_at_a_new_one() -> None:
    bp = controller(batch_size=4, warmup_steps=0, ema_decay=0.9)
    first = bp.observe(record(0, 4, speed=1.0))
    second = bp.observe(record(1, 4, speed=2.0))
    x = LAM * usl_throughput(16, SIGMA, KAPPA)
    assert first["train/backpressure/ema_throughput_tok_s"] == pytest.approx(x)
    assert second["train/backpressure/ema_throughput_tok_s"] == pytest.approx(0.9 * x + 0.1 * 2 * x)
    other = bp.observe(record(2, 8))
    assert other["train/backpressure/ema_throughput_tok_s"] == pytest.approx(LAM * usl_throughput(32, SIGMA, KAPPA))


def test_without_three_batch_sizes_there_is_no_fit_and_the_size_holds(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="retrain.training.backpressure"):
        bp = controller(batch_size=8, warmup_steps=0)
    assert "cannot be fitted" in caplog.text
    metrics = run_steps(bp, range(5))
    assert {(m["train/backpressure/regime"], m["train/backpressure/action"]) for m in metrics} == {("unfitted", "hold")}
    assert "train/backpressure/sigma" not in metrics[-1] and bp.batch_size(5) == 8


def test_the_controller_clamps_to_its_bounds() -> None:
    bp = controller(batch_size=16, min_batch_size=8, max_batch_size=32)
    assert bp.batch_size(100) == 16 and [bp.batch_size(s) for s in range(4)] == [8, 16, 32, 8]
    run_steps(bp, range(11))
    assert bp.batch_size(11) == 8  # the throttle target, 4, is below the floor
    assert controller(batch_size=100, max_batch_size=32).batch_size(10) == 32


def test_a_resumed_controller_continues_exactly() -> None:
    uninterrupted, first_half = controller(batch_size=16), controller(batch_size=16)
    run_steps(uninterrupted, range(12))
    run_steps(first_half, range(12))
    resumed = controller(batch_size=16)
    resumed.load_state_dict(json.loads(json.dumps(first_half.state_dict())))  # as the checkpoint stores it
    assert resumed.state_dict() == uninterrupted.state_dict()
    for step in range(12, 30):
        speed = 1.0 + 0.1 * math.sin(step)  # noisy measurements: the EMA and the window must match too
        assert resumed.batch_size(step) == uninterrupted.batch_size(step)
        batch = uninterrupted.batch_size(step)
        assert resumed.observe(record(step, batch, speed)) == uninterrupted.observe(record(step, batch, speed))
    assert resumed.state_dict() == uninterrupted.state_dict()


def test_checkpoints_cross_between_fixed_and_adaptive_batching(caplog: pytest.LogCaptureFixture) -> None:
    bp = controller(batch_size=16)
    with caplog.at_level(logging.INFO, logger="retrain.training.backpressure"):
        bp.load_state_dict(FixedBatching(8).state_dict())
    assert "starts fresh" in caplog.text and bp.batch_size(20) == 16
    run_steps(bp, range(11))
    fixed = FixedBatching(8)
    fixed.load_state_dict(bp.state_dict())  # back-pressure switched off on resume: the configured size stands
    assert fixed.batch_size(11) == 8


def test_the_roofline_hint_reports_the_nearer_roof() -> None:
    roofline = Roofline(peak_gflops=1000.0, peak_bw_gb_s=1000.0, parameters=10**9, parameter_bytes=2 * 10**9)
    # 6 GFLOP per token · 100 tokens/s = 0.6 of the compute peak; 2 GB per decode step · 10 steps/s = 0.02 of the bandwidth
    assert roofline.hint(100.0, 10) == pytest.approx(
        {"compute_utilization": 0.6, "bandwidth_utilization": 0.02, "roofline": "compute"}
    )
    # a 4B bf16 model on an H100 (989 TFLOP/s, 3350 GB/s) at 1000 tokens/s: few sequences per decode step make
    # every step read all 8 GB of weights for little compute; many sequences share each read
    h100 = Roofline(peak_gflops=989_000.0, peak_bw_gb_s=3350.0, parameters=4 * 10**9, parameter_bytes=8 * 10**9)
    assert h100.hint(1000.0, 64)["roofline"] == "memory" and h100.hint(1000.0, 256)["roofline"] == "compute"
    assert Roofline(0.0, 1000.0, 10**9, 2 * 10**9).hint(100.0, 1) == pytest.approx({"bandwidth_utilization": 0.2})


def test_build_batching_picks_the_part_and_counts_the_models_parameters() -> None:
    assert isinstance(build_batching(BackpressureConfig(), 8, G, None), FixedBatching)
    model = torch.nn.Linear(4, 3)  # 15 float32 parameters, 60 bytes
    settings = BackpressureConfig(enabled=True, peak_gflops=1.0, peak_bw_gb_s=1.0)
    bp = build_batching(settings, 8, G, model)
    assert isinstance(bp, BackpressureController) and bp.roofline == Roofline(1.0, 1.0, 15, 60)
    metrics = bp.observe(record(0, bp.batch_size(0)))
    assert metrics["train/backpressure/roofline"] in {"compute", "memory"}
    remote = build_batching(settings, 8, G, None)  # a remote backend holds no model here: no hint
    assert isinstance(remote, BackpressureController) and remote.roofline is None


# ---- the config ---------------------------------------------------------------------------------
def test_the_seeds_keys_and_defaults() -> None:
    cfg = compose(["backpressure.enabled=true"])
    assert OmegaConf.to_object(cfg.backpressure) == BackpressureConfig(
        enabled=True,
        warmup_steps=10,
        ema_decay=0.9,
        throttle_margin=0.85,
        increase_margin=0.5,
        min_batch_size=1,
        max_batch_size=64,
        peak_gflops=0.0,
        peak_bw_gb_s=0.0,
    )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ("backpressure.ema_decay=1.0", r"backpressure.ema_decay must be in \[0, 1\), got 1.0"),
        ("backpressure.throttle_margin=0", r"backpressure.throttle_margin must be in \(0, 1\]"),
        ("backpressure.increase_margin=1.5", r"backpressure.increase_margin must be in \(0, 1\]"),
        ("backpressure.warmup_steps=-1", "backpressure.warmup_steps must be >= 0"),
        ("backpressure.min_batch_size=0", "backpressure.min_batch_size must be >= 1"),
        ("backpressure.min_batch_size=4 backpressure.max_batch_size=2", "max_batch_size must be >= min_batch_size 4"),
        ("backpressure.peak_gflops=-1", "backpressure.peak_gflops must be >= 0"),
    ],
)
def test_a_bad_value_fails_naming_its_key(overrides: str, message: str) -> None:
    cfg = compose(["backpressure.enabled=true", *overrides.split()])
    with pytest.raises(ConfigError, match=message):
        OmegaConf.to_object(cfg.backpressure)


def test_an_unknown_key_is_refused() -> None:
    with pytest.raises(ConfigError, match="unknown config key 'backpressure.warmup'"):
        check_known_keys(compose(["+backpressure.warmup=3"]))


def test_back_pressure_is_part_of_the_run_identity_only_when_on() -> None:
    assert not any(key.startswith("backpressure.") for key in config_identity(compose([])))
    identity = config_identity(compose(["backpressure.enabled=true", "backpressure.peak_gflops=990"]))
    assert identity["backpressure.enabled"] is True and identity["backpressure.max_batch_size"] == 64
    assert "backpressure.peak_gflops" not in identity  # a hint that is logged, never acted on


@pytest.mark.parametrize("speed", [0.5, 0.6, 0.7])
def test_one_slow_step_keeps_the_warmups_fit_and_is_seen_as_retrograde(speed: float) -> None:
    # sweep 1, 2, 4 prompts (p = 4, 8, 16), then one slow step at p = 12: the least-squares refit
    # describes no curve (λ = 0 at 0.5x, 0.6x) or clamps to σ = 1 (0.7x, then read as memory_bound);
    # the warm-up's fit must stand and judge that step
    bp = controller(batch_size=3, max_batch_size=4, warmup_steps=3)
    run_steps(bp, range(3))
    good = dict(bp.fit or {})
    assert good["lam"] == pytest.approx(LAM)
    slow = bp.observe(record(3, 3, speed=speed))
    assert bp.fit == good
    assert slow["train/backpressure/regime"] == "retrograde" and slow["train/backpressure/action"] == "throttle"
    assert slow["train/backpressure/throughput_vs_model"] == pytest.approx(speed)


def test_a_refit_replaces_the_fit_when_it_explains_the_points_better() -> None:
    slower = fit_usl([(p, 0.5 * LAM * usl_throughput(p, SIGMA, KAPPA)) for p in [4, 8, 16, 32]])
    points = [(p, LAM * usl_throughput(p, SIGMA, KAPPA)) for p in [4, 8, 16, 32]]
    assert better_fit(fit_usl(points), slower, points)
    assert not better_fit(slower, fit_usl(points), points)
    assert not better_fit({"sigma": 0.0, "kappa": 0.0, "lam": 0.0}, slower, points)
