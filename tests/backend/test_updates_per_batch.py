"""Several optimizer steps per batch (training.updates_per_batch, training.mini_batches; docs/loss.md): π_old is
the trainer's own log-probs once per batch, so the second update's ratio moves and clips as computed by hand;
mini-batches step once each, each aggregated over its own tokens; the schedule spans every optimizer step."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from retrain.backend.settings import LossSettings, OptimSettings
from retrain.config import TrainingConfig
from retrain.objective.support import check_objective_support
from tests.backend.test_local_training import batch_for, sample
from tests.backend.tiny_model import make_backend

CLIP = 0.05


def optim(lr: float = 1e-2, **training) -> OptimSettings:
    return OptimSettings.from_config(TrainingConfig(lr=lr, max_grad_norm=0.0, **training))


def test_the_second_update_clips_against_the_batchs_own_old_policy(tiny_spec) -> None:
    """Before the second optimizer step, the adapter is the first step's: its log-probs give r = π/π_old, the
    clipped surrogate −min(r·A, clip(r, 1−ε, 1+ε)·A) token-mean, and the clipped tokens, by hand."""
    loss = LossSettings.from_config(TrainingConfig(clip_eps=CLIP))
    backend = make_backend(tiny_spec, loss=loss, optim=optim(lr=0.05, updates_per_batch=2))
    batch = batch_for(sample(backend))
    rollouts, advantages = batch.rollouts, batch.advantages
    trained = rollouts.trained_mask & (advantages != 0)
    rows = trained.any(dim=1).nonzero().squeeze(-1)
    old = backend._no_grad_logprobs(rollouts, rows, adapter=True)
    seen: list[torch.Tensor] = []
    backend.optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: seen.append(backend._no_grad_logprobs(rollouts, rows, adapter=True))
    )
    result = backend.train(batch)
    assert len(seen) == 2
    torch.testing.assert_close(seen[0], old)  # the first step sees the weights that sampled: ratio 1
    ratio = torch.exp(seen[1] - old)[trained]
    assert (ratio - 1).abs().max() > CLIP  # the second update's ratio is not 1, and leaves the clip range
    a = advantages[trained]
    second = -torch.minimum(ratio * a, ratio.clamp(1 - CLIP, 1 + CLIP) * a).mean()
    clipped_by_hand = float((ratio.clamp(1 - CLIP, 1 + CLIP) * a < ratio * a).sum())
    first = -a.mean()
    assert result.loss == pytest.approx(float(first + second) / 2, rel=1e-4)
    assert clipped_by_hand > 0
    assert result.metrics["policy/clip_frac"] == pytest.approx(clipped_by_hand / (2 * len(a)))
    assert result.metrics["optim/steps"] == 2.0


def test_mini_batches_step_once_each_over_their_own_tokens(tiny_spec) -> None:
    """mini_batches=2 over 4 groups of 4: two optimizer steps on groups 0-1 then 2-3, each loss the token mean over
    its own tokens (at an lr too small to move the ratio off 1: −mean A of its rows), the batch's loss their mean."""
    backend = make_backend(tiny_spec, optim=optim(lr=1e-9, mini_batches=2))
    row_mask = torch.ones(16, dtype=torch.bool)
    row_mask[13:] = False  # group 3 keeps one row: the two mini-batches hold different token counts
    batch = batch_for(sample(backend, group_size=4), row_mask=row_mask)
    result = backend.train(batch)
    assert {int(state["step"]) for state in backend.optimizer.state.values()} == {2}
    assert backend.scheduler.last_epoch == 2
    trained = batch.rollouts.trained_mask & (batch.advantages != 0)
    groups = [slice(0, 8), slice(8, 16)]
    per_group = [float(-batch.advantages[rows][trained[rows]].mean()) for rows in groups]
    assert result.loss == pytest.approx(sum(per_group) / 2, rel=1e-4)
    assert result.loss != pytest.approx(float(-batch.advantages[trained].mean()), rel=1e-3)
    assert result.num_tokens == int(trained.sum())


def test_the_schedule_spans_every_optimizer_step() -> None:
    settings = optim(max_steps=10, updates_per_batch=2, mini_batches=3)
    assert (settings.max_steps, settings.steps_per_batch) == (60, 6)


@pytest.mark.parametrize("key", ["updates_per_batch", "mini_batches"])
def test_a_bad_count_names_its_key(key: str) -> None:
    with pytest.raises(Exception, match=f"training.{key} must be >= 1, got 0"):
        optim(**{key: 0})


@pytest.mark.parametrize("budget", [1, 100])
def test_micro_batches_give_the_same_steps(tiny_spec, budget: int) -> None:
    """Two updates × two mini-batches with tis: the same losses and metrics over the 4 steps and the same first
    gradient however rows are split (later gradients drift by Adam-amplified fp32 rounding)."""
    loss = replace(LossSettings.from_config(TrainingConfig(clip_eps=0.2)), mismatch_mode="tis")
    results, gradients = [], []
    for micro_batch_tokens in (0, budget):
        backend = make_backend(
            tiny_spec,
            loss=loss,
            micro_batch_tokens=micro_batch_tokens,
            optim=optim(updates_per_batch=2, mini_batches=2),
        )
        steps: list[list[torch.Tensor]] = []
        backend.optimizer.register_step_pre_hook(
            lambda opt, args, kwargs, b=backend, s=steps: s.append([p.grad.clone() for p in b.trainable])
        )
        results.append(backend.train(batch_for(sample(backend))))
        assert len(steps) == 4
        gradients.append(steps[0])
    assert results[1].loss == pytest.approx(results[0].loss, rel=1e-5, abs=1e-7) and results[0].loss != 0
    for key in ("policy/clip_frac", "policy/ratio_mean", "mismatch/kl"):
        assert results[1].metrics[key] == pytest.approx(results[0].metrics[key], rel=1e-5, abs=1e-7)
    for split, one in zip(gradients[1], gradients[0], strict=True):
        torch.testing.assert_close(split, one, rtol=1e-5, atol=1e-6)


def test_a_remote_backend_refuses_several_updates_naming_the_key() -> None:
    class Remote:  # a backend without `objective_keys`: it computes only the defaults
        pass

    for key, value in (("updates_per_batch", 2), ("mini_batches", 2), ("mismatch_mode", "tis")):
        with pytest.raises(Exception, match=f"training.{key}={value}: backend .*Remote computes only"):
            check_objective_support(TrainingConfig(**{key: value}), Remote)
    check_objective_support(TrainingConfig(mismatch_mode="none"), Remote)
