"""Token transforms and batch steps: exact values per docs/advantages.md, and their properties (hypothesis)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from retrain.algorithm.batch import AdvantageCap, BatchNormalization
from retrain.algorithm.tokens import TokenBatch
from retrain.algorithm.transforms import HICRA, GTPOWeighting, SEPAAmplification, SEPAPooling, SurprisalMask
from retrain.errors import ConfigError

T = torch.tensor


def token_batch(uncertainty, mask=None, planning=None, advantages=None, group_size=None, lam=0.0) -> TokenBatch:
    u = T(uncertainty, dtype=torch.float32)
    mask = torch.ones_like(u, dtype=torch.bool) if mask is None else T(mask, dtype=torch.bool)
    u = u * mask
    advantages = torch.ones_like(u) * mask if advantages is None else T(advantages, dtype=torch.float32) * mask
    planning = None if planning is None else T(planning, dtype=torch.bool) & mask
    return TokenBatch(
        advantages=advantages,
        uncertainty=u,
        raw_uncertainty=u,
        mask=mask,
        planning=planning,
        group_size=group_size or u.shape[0],
        sepa_lambda=lam,
    )


# ---- exact values ----------------------------------------------------------------------------------


def test_sepa_pools_execution_tokens_towards_their_mean():
    batch = token_batch([[1.0, 2.0, 3.0, 6.0, 9.0]], mask=[[1, 1, 1, 1, 0]], planning=[[0, 1, 0, 0, 0]], lam=0.5)
    mu = 10.0 / 3.0
    expected = T([[0.5 * mu + 0.5, 2.0, 0.5 * mu + 1.5, 0.5 * mu + 3.0, 0.0]])
    torch.testing.assert_close(SEPAPooling()(batch).uncertainty, expected)


def test_sepa_leaves_a_completion_without_execution_tokens_and_lambda_zero_unchanged():
    batch = token_batch([[1.0, 4.0]], planning=[[1, 1]], lam=1.0)
    assert torch.equal(SEPAPooling()(batch).uncertainty, batch.uncertainty)
    still = token_batch([[1.0, 4.0]], planning=[[0, 1]], lam=0.0)
    assert SEPAPooling()(still) is still


def test_sepa_clamps_lambda_to_one():
    batch = token_batch([[1.0, 3.0, 8.0]], planning=[[0, 0, 1]], lam=7.0)
    assert SEPAPooling()(batch).uncertainty.tolist() == [[2.0, 2.0, 8.0]]


def test_sepa_amplification_pushes_away_and_the_clamped_variant_floors_at_zero():
    batch = token_batch([[1.0, 2.0, 3.0, 6.0]], planning=[[0, 1, 0, 0]], lam=0.5)
    mu = 10.0 / 3.0
    amp = T([[1.5 - 0.5 * mu, 2.0, 4.5 - 0.5 * mu, 9.0 - 0.5 * mu]])
    torch.testing.assert_close(SEPAAmplification()(batch).uncertainty, amp)
    torch.testing.assert_close(SEPAAmplification(floor_at_zero=True)(batch).uncertainty, amp.clamp_min(0.0))


def test_gtpo_weights_by_relative_uncertainty():
    batch = token_batch([[1.0, 2.0, 3.0, 6.0, 0.0]], mask=[[1, 1, 1, 1, 0]], advantages=[[2.0] * 5])
    m = 3.0 + 1e-8
    expected = T([[2.0 * (1 + 0.1 * (u / m - 1)) for u in (1.0, 2.0, 3.0, 6.0)] + [0.0]])
    torch.testing.assert_close(GTPOWeighting(beta=0.1)(batch).advantages, expected)


def test_gtpo_floors_weights_at_zero_and_keeps_flat_completions():
    batch = token_batch([[1.0, 2.0, 6.0], [0.0, 5e-8, 0.0]], advantages=[[2.0] * 3, [-1.0] * 3])
    out = GTPOWeighting(beta=2.0)(batch).advantages
    m = 3.0 + 1e-8
    torch.testing.assert_close(out[0], T([0.0, 2.0 * (1 + 2.0 * (2.0 / m - 1)), 2.0 * (1 + 2.0 * (6.0 / m - 1))]))
    assert out[1].tolist() == [-1.0, -1.0, -1.0]  # mean uncertainty < 1e-7
    assert GTPOWeighting(beta=0.0)(batch) is batch


def test_hicra_amplifies_planning_tokens_by_their_magnitude():
    batch = token_batch([[0.0] * 4], planning=[[1, 1, 0, 1]], advantages=[[1.0, -1.0, 2.0, -2.0]])
    torch.testing.assert_close(HICRA(alpha=0.2)(batch).advantages, T([[1.2, -0.8, 2.0, -1.6]]))
    with pytest.raises(ConfigError, match=r"algorithm.hicra.alpha=1.5 must be in \[0, 1\]"):
        HICRA(alpha=1.5)


def test_surprisal_mask_keeps_each_groups_top_rho_with_ties():
    # group 0: six real tokens 5,1,3 | 2,4,4 -> k = floor(6 * 0.5) = 3 -> threshold 4 (ties kept)
    # group 1: three real tokens 0.3,0.1 | 0.2 -> k = max(1, floor(1.5)) = 1 -> threshold 0.3
    batch = token_batch(
        [[5.0, 1.0, 3.0, 0.0], [2.0, 4.0, 4.0, 0.0], [0.3, 0.1, 0.0, 0.0], [0.2, 0.0, 0.0, 0.0]],
        mask=[[1, 1, 1, 0], [1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 0, 0]],
        group_size=2,
    )
    out = SurprisalMask(rho=0.5)(batch)
    assert out.advantages.tolist() == [[1, 0, 0, 0], [0, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]]
    assert out.metrics["surprisal_mask_fraction"] == pytest.approx(5 / 9)
    assert out.metrics["surprisal_mask_threshold"] == pytest.approx((4.0 + 0.3) / 2)


def test_surprisal_mask_reads_the_raw_uncertainty_and_rho_one_keeps_all():
    batch = token_batch([[1.0, 2.0, 3.0]], group_size=1)
    pooled = replace(batch, uncertainty=torch.full((1, 3), 9.0))
    assert SurprisalMask(rho=0.34)(pooled).advantages.tolist() == [[0.0, 0.0, 1.0]]
    assert SurprisalMask(rho=1.0)(batch).advantages.tolist() == [[1.0, 1.0, 1.0]]


def test_batch_normalisation_uses_nonzero_entries_only():
    batch = token_batch([[0.0] * 3] * 2, advantages=[[1.0, 2.0, 0.0], [3.0, 0.0, 0.0]])
    out = BatchNormalization()(batch)
    sigma = (2.0 / 3.0) ** 0.5
    torch.testing.assert_close(out.advantages, T([[-1.0 / (sigma + 1e-8), 0.0, 0.0], [1.0 / (sigma + 1e-8), 0.0, 0.0]]))
    assert out.metrics == pytest.approx({"batch_adv_mean": 2.0, "batch_adv_std": sigma, "batch_adv_count": 3.0})


def test_batch_normalisation_only_centres_when_the_spread_is_zero():
    batch = token_batch([[0.0] * 3], advantages=[[0.3, 0.3, 0.0]])
    assert BatchNormalization()(batch).advantages.abs().max() < 1e-7


def test_advantage_cap_clamps_nonzero_entries_and_reports_the_fraction():
    batch = token_batch([[0.0] * 3] * 2, advantages=[[3.0, -0.5, 0.0], [-4.0, 1.0, 0.0]])
    out = AdvantageCap(cap=2.0)(batch)
    assert out.advantages.tolist() == [[2.0, -0.5, 0.0], [-2.0, 1.0, 0.0]]
    assert out.metrics["adv_cap_fraction"] == 0.5


# ---- properties ------------------------------------------------------------------------------------

ROWS, TOKENS = st.integers(1, 6), st.integers(1, 24)
LAMBDAS = st.floats(0.0, 1.0)


@st.composite
def token_batches(draw, max_uncertainty: float = 50.0, lam=LAMBDAS):
    rows, tokens = draw(ROWS), draw(TOKENS)
    u = draw(arrays(np.float32, (rows, tokens), elements=st.floats(0.0, max_uncertainty, width=32)))
    lengths = draw(arrays(np.int64, (rows,), elements=st.integers(0, tokens)))
    planning = draw(arrays(np.bool_, (rows, tokens)))
    episode = draw(arrays(np.float32, (rows, 1), elements=st.floats(-10, 10, width=32)))
    mask = np.arange(tokens)[None, :] < lengths[:, None]
    return token_batch(
        u.tolist(),
        mask=mask.tolist(),
        planning=planning.tolist(),
        advantages=np.broadcast_to(episode, (rows, tokens)).tolist(),
        group_size=1,
        lam=draw(lam),
    )


@settings(max_examples=100, deadline=None)
@given(token_batches(), st.floats(-3.0, 5.0))
def test_gtpo_never_flips_a_sign(batch, beta):
    out = GTPOWeighting(beta=beta)(batch).advantages
    assert torch.all(out * batch.advantages >= 0)


@settings(max_examples=100, deadline=None)
@given(token_batches(), st.floats(0.0, 0.99))
def test_gtpo_keeps_the_sequence_mean_when_no_weight_is_floored(batch, beta):
    # beta < 1 keeps every weight >= 1 - beta > 0, so none is floored
    lengths = batch.mask.sum(dim=1)
    real = lengths > 0
    mean_uncertainty = (batch.uncertainty * batch.mask).sum(dim=1)[real] / lengths[real]
    # the 1e-8 in GTPO's w = 1 + beta * (u / (m + 1e-8) - 1) shifts the mean by beta * 1e-8 / m:
    # only uncertainties far above 1e-8 (or below the 1e-7 cut-off, where GTPO is the identity) keep it
    assume(bool(((mean_uncertainty >= 1e-3) | (mean_uncertainty < 1e-7)).all()))
    out = GTPOWeighting(beta=beta)(batch).advantages
    before = batch.advantages.sum(dim=1)[real] / lengths[real]
    after = out.sum(dim=1)[real] / lengths[real]
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)


@settings(max_examples=100, deadline=None)
@given(token_batches(lam=st.just(1.0)))
def test_sepa_with_lambda_one_leaves_zero_execution_variance(batch):
    pooled = SEPAPooling()(batch).uncertainty
    execution = batch.execution_mask()
    for row in range(pooled.shape[0]):
        values = pooled[row][execution[row]]
        if values.numel():
            assert torch.all(values == values[0])


@settings(max_examples=100, deadline=None)
@given(token_batches(lam=st.just(0.0)))
def test_sepa_with_lambda_zero_is_the_identity(batch):
    for transform in (SEPAPooling(), SEPAAmplification(), SEPAAmplification(floor_at_zero=True)):
        assert torch.equal(transform(batch).uncertainty, batch.uncertainty)


@settings(max_examples=100, deadline=None)
@given(token_batches(), st.floats(0.0, 1.0))
def test_hicra_never_flips_a_sign(batch, alpha):
    varied = GTPOWeighting(beta=0.5)(batch)  # token-varying advantages of both signs
    out = HICRA(alpha=alpha)(varied).advantages
    assert torch.all(out * varied.advantages >= 0)
    untouched = ~varied.planning
    assert torch.equal(out[untouched], varied.advantages[untouched])
