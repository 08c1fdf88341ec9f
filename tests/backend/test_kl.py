"""KL to the base model (training.kl_coef): the k3 estimator, the base model's log-probs from the same
model with its LoRA adapter disabled, and kl_coef = 0 leaving training exactly as it was."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from retrain.assets import TINY_MODEL_DIR
from retrain.backend.settings import LossSettings
from retrain.errors import ConfigError
from retrain.model.logprobs import completion_logprobs
from retrain.objective.policy import k3_kl, policy_token_loss
from retrain.types import Rollouts, TrainBatch
from tests.backend.test_local_training import SAMPLING, batch_for, lora_state, sample
from tests.backend.tiny_model import make_backend

NO_CLIP = {"clip_eps": 0.0, "clip_eps_high": None}


def test_k3_by_hand() -> None:
    """The reference values of docs/loss.md: p = 0.5 under the policy, q = 0.25 under the base model."""
    policy = torch.log(torch.tensor([0.5, 0.25, 0.5]))
    base = torch.log(torch.tensor([0.25, 0.5, 0.5]))
    # exp(log q − log p) − (log q − log p) − 1: 0.5 + ln 2 − 1, 2 − ln 2 − 1, and 0 where they agree
    expected = torch.tensor([0.5 + math.log(2) - 1, 2 - math.log(2) - 1, 0.0])
    torch.testing.assert_close(k3_kl(policy, base), expected)
    assert k3_kl(policy, base)[0].item() == pytest.approx(0.193147, abs=1e-6)
    assert k3_kl(policy, base)[1].item() == pytest.approx(0.306853, abs=1e-6)


def test_the_loss_adds_kl_coef_times_k3_and_its_gradient_pulls_towards_the_base() -> None:
    new = torch.log(torch.tensor([0.5, 0.25])).requires_grad_()
    old = new.detach().clone()
    base = torch.log(torch.tensor([0.25, 0.5]))
    advantages = torch.tensor([1.0, -1.0])
    result = policy_token_loss(new, old, advantages, LossSettings(**NO_CLIP, kl_coef=0.1), base)
    k3 = torch.tensor([0.5 + math.log(2) - 1, 2 - math.log(2) - 1])
    torch.testing.assert_close(result.loss.detach(), -advantages + 0.1 * k3)
    torch.testing.assert_close(result.kl, k3)
    result.loss.sum().backward()
    # d/dlogp of −ratio·A is −A; of k3 it is 1 − exp(base − logp): 1 − 0.5 and 1 − 2
    torch.testing.assert_close(new.grad, -advantages + 0.1 * torch.tensor([0.5, -1.0]))


def test_kl_coef_zero_is_the_loss_without_the_term_bitwise() -> None:
    new = torch.randn(3, 5)
    old, base, advantages = torch.randn(3, 5), torch.randn(3, 5), torch.randn(3, 5)
    for clip in (NO_CLIP, {"clip_eps": 0.2, "clip_eps_high": 0.28}):
        without = policy_token_loss(new, old, advantages, LossSettings(**clip))
        zero = policy_token_loss(new, old, advantages, LossSettings(**clip, kl_coef=0.0), base)
        assert torch.equal(without.loss, zero.loss) and torch.equal(without.clipped, zero.clipped)
        assert zero.kl is None


@pytest.mark.parametrize("value", [-0.1, float("nan")])
def test_a_negative_or_nan_kl_coef_is_refused(value: float) -> None:
    with pytest.raises(ConfigError, match="training.kl_coef must be >= 0"):
        LossSettings(**NO_CLIP, kl_coef=value)


def base_model_kl(backend, rollouts: Rollouts, batch: TrainBatch) -> float:
    """Mean k3 over the step's trained tokens, the base model loaded anew from its files."""
    base = AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR, dtype=torch.float32)
    index = torch.arange(rollouts.num_rows) // rollouts.group_size
    shared = (rollouts.prompt_ids, rollouts.prompt_mask, index, rollouts.completion_ids, rollouts.completion_mask)
    backend.model.train()
    with torch.no_grad():
        policy = completion_logprobs(backend.model, *shared, SAMPLING.temperature)
        reference = completion_logprobs(base, *shared, SAMPLING.temperature)
    trained = rollouts.completion_mask & (batch.advantages != 0) & batch.row_mask.unsqueeze(1)
    return float(k3_kl(policy, reference)[trained].mean())


def test_policy_kl_is_k3_against_the_base_model(tiny_spec) -> None:
    """The adapter starts at zero (B = 0), so the first step's KL is 0; after it, the logged KL is the k3
    of the trained tokens against the base model's own weights."""
    backend = make_backend(tiny_spec, lr=0.05, loss=LossSettings(**NO_CLIP, kl_coef=0.1))
    rollouts = sample(backend)
    batch = batch_for(rollouts)
    first = backend.train(batch)
    assert first.metrics["policy/kl"] == pytest.approx(0.0, abs=1e-7)
    expected = base_model_kl(backend, rollouts, batch)
    second = backend.train(batch)
    assert expected > 1e-4
    assert second.metrics["policy/kl"] == pytest.approx(expected, rel=1e-4)


def test_micro_batches_give_the_same_kl(tiny_spec) -> None:
    results = []
    for micro_batch_tokens in (0, 100):  # all rows at once; ~35 padded tokens a row, so two or three a micro-batch
        backend = make_backend(tiny_spec, loss=LossSettings(**NO_CLIP, kl_coef=0.1))
        batch = batch_for(sample(backend))
        backend.train(batch)
        backend.micro_batch_tokens = micro_batch_tokens
        results.append(backend.train(batch))
    assert results[0].metrics["policy/kl"] == pytest.approx(results[1].metrics["policy/kl"], rel=1e-5)
    assert results[0].loss == pytest.approx(results[1].loss, rel=1e-5)


def test_kl_coef_zero_trains_bitwise_as_before_and_runs_no_base_forward(tiny_spec) -> None:
    states, losses, forwards = [], [], []
    for loss in (LossSettings(**NO_CLIP), LossSettings(**NO_CLIP, kl_coef=0.0), LossSettings(**NO_CLIP, kl_coef=0.1)):
        backend = make_backend(tiny_spec, loss=loss)
        batch = batch_for(sample(backend))
        calls = [0]
        backend.model.get_base_model().register_forward_hook(lambda *_, calls=calls: calls.__setitem__(0, calls[0] + 1))
        result = backend.train(batch)
        losses.append(result.loss)
        states.append(lora_state(backend))
        forwards.append(calls[0])
        assert ("policy/kl" in result.metrics) == (loss.kl_coef > 0)
    assert losses[0] == losses[1] and all(torch.equal(states[0][k], states[1][k]) for k in states[0])
    assert forwards[0] == forwards[1] and forwards[2] == 2 * forwards[0]  # kl_coef > 0: one more forward each
