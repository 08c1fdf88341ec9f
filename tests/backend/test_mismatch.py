"""Sampler–trainer mismatch correction (training.mismatch_mode, docs/loss.md): tis and mask at token and
sequence level against the papers' formulas by hand, their metrics, and the local backend applying them."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from retrain.backend.settings import LossSettings
from retrain.commands.explain import composed
from retrain.config import TrainingConfig
from retrain.errors import ConfigError
from retrain.objective.aggregation import aggregation
from retrain.objective.mismatch import correction, log_weights, mismatch_sums
from retrain.objective.policy import policy_token_loss
from retrain.run import plan_parts, sampler_is_trainer
from tests.backend.test_local_training import batch_for, sample
from tests.backend.tiny_model import make_backend

# three rows of at most two tokens; row 2 has one real token
NEW = torch.log(torch.tensor([[0.5, 0.4], [0.6, 0.5], [0.5, 1.0]]))
TRAINER = torch.log(torch.tensor([[0.5, 0.5], [0.5, 0.5], [0.5, 1.0]]))  # π_old_trainer
SAMPLER = torch.log(torch.tensor([[0.25, 0.5], [0.5, 0.4], [0.5, 1.0]]))  # w = 2, 1 | 1, 1.25 | 1
ADVANTAGES = torch.tensor([[1.0, 3.0], [1.0, 1.0], [-2.0, 0.0]])
MASK = torch.tensor([[True, True], [True, True], [True, False]])


def corrected_loss_and_gradient(settings: LossSettings) -> tuple[float, torch.Tensor]:
    """The backend's composition on one rank: policy loss against π_old_trainer, times the correction, token_mean."""
    new = NEW.clone().requires_grad_()
    token_loss = policy_token_loss(new, TRAINER, ADVANTAGES, settings, mask=MASK)
    factor = correction(log_weights(SAMPLER, TRAINER, MASK, settings.mismatch_level), settings)
    agg = aggregation(settings.loss_agg, MASK, settings.loss_agg_constant, lambda count: count)
    loss = (token_loss.loss * agg.weights * factor).sum() / agg.divisor
    loss.backward()
    assert new.grad is not None
    return float(loss.detach()), new.grad


def by_hand(factor: list[list[float]]) -> tuple[float, torch.Tensor]:
    """ppo's default (clip_eps 0): ℓ = −f·(π/π_old_trainer)·A, token mean over the 5 trained tokens; dℓ/dlogπ = ℓ."""
    ratio = [[0.5 / 0.5, 0.4 / 0.5], [0.6 / 0.5, 0.5 / 0.5], [1.0, 1.0]]
    grads = [
        [-factor[r][t] * ratio[r][t] * float(ADVANTAGES[r, t]) * bool(MASK[r, t]) / 5 for t in range(2)]
        for r in range(3)
    ]
    return sum(map(sum, grads)), torch.tensor(grads)


def settings(**overrides) -> LossSettings:
    return replace(LossSettings.from_config(TrainingConfig()), **overrides)


@pytest.mark.parametrize(
    ("overrides", "factor"),
    [
        # tis token: min(w, C) per token; C = 1.5 truncates w = 2 (row 0 token 0)
        ({"mismatch_mode": "tis", "mismatch_cap": 1.5}, [[1.5, 1.0], [1.0, 1.25], [1.0, 1.0]]),
        # tis sequence: one w per row, the product of its tokens' (2, 1.25, 1), capped at 2 (paper default)
        ({"mismatch_mode": "tis", "mismatch_level": "sequence"}, [[2.0, 2.0], [1.25, 1.25], [1.0, 1.0]]),
        # mask token: w outside [0.9, 1.2] drops the token (2 and 1.25)
        ({"mismatch_mode": "mask", "mismatch_lower": 0.9, "mismatch_upper": 1.2}, [[0, 1], [1, 0], [1, 1]]),
        # mask sequence: rows 0 (w 2) and 1 (w 1.25) leave the loss; the divisor stays 5 tokens
        (
            {"mismatch_mode": "mask", "mismatch_level": "sequence", "mismatch_lower": 0.9, "mismatch_upper": 1.2},
            [[0, 0], [0, 0], [1, 1]],
        ),
    ],
    ids=["tis-token", "tis-sequence", "mask-token", "mask-sequence"],
)
def test_correction_by_hand(overrides: dict, factor: list[list[float]]) -> None:
    loss, gradient = corrected_loss_and_gradient(settings(**overrides))
    expected_loss, expected_gradient = by_hand(factor)
    assert loss == pytest.approx(expected_loss, rel=1e-6)
    torch.testing.assert_close(gradient, expected_gradient)


def test_metric_sums_by_hand() -> None:
    tis = mismatch_sums(SAMPLER, TRAINER, MASK, settings(mismatch_mode="tis", mismatch_cap=1.5))
    gaps = [math.log(2.0), 0.0, 0.0, math.log(1.25), 0.0]  # log π_trainer − log π_sampler per trained token
    assert tis.ratio == pytest.approx(2 + 1 + 1 + 1.25 + 1)
    assert (tis.ratio_min, tis.ratio_max) == pytest.approx((1.0, 2.0))
    assert tis.log_gap == pytest.approx(-sum(gaps))
    assert tis.kl == pytest.approx(sum(math.exp(g) - g - 1 for g in gaps))
    assert (tis.truncated, tis.masked) == (1.0, 0.0)
    mask = mismatch_sums(SAMPLER, TRAINER, MASK, settings(mismatch_mode="mask", mismatch_upper=1.2))
    assert (mask.truncated, mask.masked) == (0.0, 2.0)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("mismatch_mode", "icepop", "training.mismatch_mode='icepop' is not one of: none, tis, mask"),
        ("mismatch_level", "row", "training.mismatch_level='row' is not one of: token, sequence"),
        ("mismatch_cap", 0.5, "training.mismatch_cap must be >= 1, got 0.5"),
        ("mismatch_upper", 0.9, "training.mismatch_lower/mismatch_upper must satisfy 0 <= lower <= 1 <= upper"),
    ],
)
def test_a_bad_mismatch_value_names_its_key(key: str, value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        LossSettings.from_config(TrainingConfig(**{key: value}))


def test_the_default_is_none_for_the_in_process_engine_and_tis_for_other_engines() -> None:
    assert LossSettings.from_config(TrainingConfig()).mismatch_mode == "none"
    assert LossSettings.from_config(TrainingConfig(), sampler_is_trainer=False).mismatch_mode == "tis"
    explicit = TrainingConfig(mismatch_mode="none")
    assert LossSettings.from_config(explicit, sampler_is_trainer=False).mismatch_mode == "none"


def test_the_default_step_has_no_mismatch_metrics(tiny_spec) -> None:
    """The in-process engine's default: no extra forward, the metrics as before the correction existed."""
    backend = make_backend(tiny_spec)
    result = backend.train(batch_for(sample(backend)))
    assert {key for key in result.metrics if not key.startswith("dist/")} == {
        "policy/ratio_mean",
        "policy/ratio_max",
        "policy/clip_frac",
        "engine/logprob_abs_diff",
        "train/padding_frac",
    }


@pytest.mark.parametrize("shift", [math.log(1.5), 1.0])
def test_tis_in_the_backend_weights_each_token_by_the_truncated_ratio(tiny_spec, shift: float) -> None:
    """Sampler log-probs lowered by `shift` (w = e^shift on every token): without correction the ratio against
    the sampler is e^shift; with tis it is π/π_old_trainer = 1 and each token weighs min(e^shift, 2)."""
    losses, metrics = {}, {}
    for mode in ("none", "tis"):
        backend = make_backend(tiny_spec, loss=settings(mismatch_mode=mode))
        batch = batch_for(sample(backend))
        shifted = replace(batch.rollouts, logprobs=batch.rollouts.logprobs - shift * batch.rollouts.completion_mask)
        result = backend.train(replace(batch, rollouts=shifted))
        losses[mode], metrics[mode] = result.loss, result.metrics
    assert losses["tis"] == pytest.approx(losses["none"] * min(math.exp(shift), 2.0) / math.exp(shift), rel=1e-4)
    tis = metrics["tis"]
    assert tis["policy/ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["none"]["policy/ratio_mean"] == pytest.approx(math.exp(shift), rel=1e-4)
    assert tis["mismatch/logprob_diff"] == pytest.approx(-shift, abs=1e-5)
    assert tis["mismatch/ratio_mean"] == pytest.approx(math.exp(shift), rel=1e-4)
    assert tis["mismatch/ratio_min"] == pytest.approx(math.exp(shift), rel=1e-4)
    assert tis["mismatch/kl"] == pytest.approx(math.exp(shift) - shift - 1, rel=1e-3)
    assert tis["mismatch/truncated_frac"] == (1.0 if math.exp(shift) > 2 else 0.0)
    assert tis["engine/logprob_abs_diff"] == pytest.approx(shift, abs=1e-5)


def test_mask_in_the_backend_drops_the_rows_out_of_bounds(tiny_spec) -> None:
    """Rows 0-3 (the first group) lowered by 2 (w = e² > 5): masked at sequence level, their loss gone, the
    divisor unchanged; the rest as without correction."""
    results = {}
    for mode in ("none", "mask"):
        backend = make_backend(tiny_spec, loss=settings(mismatch_mode=mode, mismatch_level="sequence"))
        batch = batch_for(sample(backend))
        rows = torch.zeros_like(batch.rollouts.logprobs)
        rows[:4] = 2.0
        shifted = replace(batch.rollouts, logprobs=batch.rollouts.logprobs - rows * batch.rollouts.completion_mask)
        masked = replace(batch, rollouts=shifted)
        results[mode] = backend.train(masked if mode == "mask" else replace(batch, advantages=_zero_first(batch)))
    kept, every = results["none"].num_tokens, results["mask"].num_tokens
    assert 0 < kept < every
    assert results["mask"].loss == pytest.approx(results["none"].loss * kept / every, rel=1e-4)
    assert results["mask"].metrics["mismatch/masked_frac"] == pytest.approx((every - kept) / every)


def _zero_first(batch) -> torch.Tensor:
    advantages = batch.advantages.clone()
    advantages[:4] = 0.0
    return advantages


def test_the_run_resolves_the_default_by_engine() -> None:
    assert sampler_is_trainer(plan_parts(composed(["experiment=quickstart"])))
    server = composed(["experiment=quickstart", "inference=vllm_server", "inference.url=http://127.0.0.1:9"])
    assert not sampler_is_trainer(plan_parts(server))
