"""backend=local training step (docs/loss.md) on a real tiny causal LM with a real LoRA adapter, on CPU."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import retrain.model.packing as packing_module
from retrain.backend.micro_batches import row_micro_batches
from retrain.backend.settings import LossSettings
from retrain.model.logprobs import completion_logprobs
from retrain.objective.policy import policy_token_loss
from retrain.types import Rollouts, SamplingParams, TrainBatch, WeightUpdate
from tests.backend.tiny_model import PROMPTS, encode, make_backend, make_engine

SAMPLING = SamplingParams(max_tokens=8, temperature=0.7, top_p=0.9, return_entropies=True)


def advantages_for(rollouts: Rollouts, seed: int) -> torch.Tensor:
    """Per-row advantages of both signs, varying per token, with some tokens exactly 0."""
    generator = torch.Generator().manual_seed(seed)
    advantages = torch.randn(rollouts.completion_ids.shape, generator=generator)
    advantages[:, ::3] = 0.0
    return advantages * rollouts.completion_mask


def batch_for(rollouts: Rollouts, seed: int = 0, row_mask: torch.Tensor | None = None) -> TrainBatch:
    rows = torch.ones(rollouts.num_rows, dtype=torch.bool) if row_mask is None else row_mask
    return TrainBatch(rollouts=rollouts, advantages=advantages_for(rollouts, seed) * rows.unsqueeze(1), row_mask=rows)


def lora_state(backend) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in backend.model.named_parameters() if "lora_" in name}


def sample(backend, seed: int = 1, group_size: int = 4) -> Rollouts:
    """Rollouts from the in-process engine on the backend's current weights."""
    return make_engine(backend).generate(encode(backend, PROMPTS), group_size, SAMPLING, seed)


def test_first_update_ratio_is_one(tiny_spec):
    backend = make_backend(tiny_spec)
    rollouts = sample(backend)
    backend.model.train()
    with torch.no_grad():
        recomputed = completion_logprobs(
            backend.model,
            rollouts.prompt_ids,
            rollouts.prompt_mask,
            torch.arange(rollouts.num_rows) // 4,
            rollouts.completion_ids,
            rollouts.completion_mask,
            SAMPLING.temperature,
        )
    ratio = torch.exp(recomputed - rollouts.logprobs)[rollouts.completion_mask]
    assert ratio.numel() > 0 and (ratio - 1).abs().max() <= 1e-4

    result = backend.train(batch_for(rollouts))
    assert not result.skipped_nonfinite and math.isfinite(result.loss)
    assert abs(result.metrics["policy/ratio_mean"] - 1) <= 1e-4
    assert abs(result.metrics["policy/ratio_max"] - 1) <= 1e-4
    assert result.metrics["policy/clip_frac"] == 0.0
    assert "policy/top_p_mass" not in result.metrics  # the sampler's metrics reach the step record from the rollouts


def test_a_step_returns_its_weight_update_and_a_skipped_step_none(tiny_spec):
    backend = make_backend(tiny_spec)
    rollouts = sample(backend)
    update = backend.train(batch_for(rollouts)).update
    assert isinstance(update, WeightUpdate) and update.version == 1 and update.adapter_dir is None
    trainable = dict(backend.model.named_parameters())
    assert update.tensors.keys() == {name for name, p in trainable.items() if p.requires_grad}
    assert all(tensor is trainable[name] for name, tensor in update.tensors.items())  # live, not copied
    assert all("lora_" in name for name in update.tensors)
    nothing = TrainBatch(
        rollouts, torch.zeros(rollouts.completion_ids.shape), torch.ones(rollouts.num_rows, dtype=torch.bool)
    )
    assert backend.train(nothing).update is None
    assert backend.train(batch_for(rollouts)).update.version == 2


def step_with_gradient(tiny_spec, micro_batch_tokens: int, loss: LossSettings | None = None):
    """A step on fresh samples of a fresh backend (with `loss`, else the defaults), with the gradient the optimizer
    saw."""
    backend = make_backend(tiny_spec, max_grad_norm=0.0, micro_batch_tokens=micro_batch_tokens, loss=loss)
    batch = batch_for(sample(backend))
    captured: dict[int, torch.Tensor] = {}
    backend.optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: captured.update({i: p.grad.clone() for i, p in enumerate(backend.trainable)})
    )
    return batch, backend.train(batch), captured


def test_token_micro_batches_give_the_one_batch_loss_and_gradient(tiny_spec):
    """Budgets of 1 token (every row alone: each is longer), 100 and 250 padded tokens split the 16 rows of ~35
    padded tokens into 16, ~8 and ~3 micro-batches; the loss is the step's token mean whatever the split."""
    batch, one, one_gradient = step_with_gradient(tiny_spec, 0)
    trained = (batch.advantages != 0).any(dim=1).nonzero().squeeze(-1)
    for budget in (1, 100, 250):
        split = row_micro_batches(batch.rollouts, trained, budget)
        assert 1 < len(split) < len(trained) or (budget == 1 and len(split) == len(trained))
        _, result, gradient = step_with_gradient(tiny_spec, budget)
        assert result.num_tokens == one.num_tokens > 0
        assert result.loss == pytest.approx(one.loss, abs=1e-6)
        assert result.grad_norm == pytest.approx(one.grad_norm, rel=1e-5)
        assert gradient.keys() == one_gradient.keys() and gradient
        for key in gradient:
            torch.testing.assert_close(gradient[key], one_gradient[key], rtol=1e-5, atol=1e-7)


def test_only_rows_with_signal_are_trained(tiny_spec):
    backend = make_backend(tiny_spec)
    rollouts = sample(backend)
    row_mask = torch.zeros(rollouts.num_rows, dtype=torch.bool)
    row_mask[4:8] = True
    batch = batch_for(rollouts, row_mask=row_mask)
    batch.advantages[~row_mask] = 5.0  # must be ignored: those rows are not in the batch
    result = backend.train(batch)
    expected = int((rollouts.completion_mask[4:8] & (batch.advantages[4:8] != 0)).sum())
    assert result.num_tokens == expected


def test_non_finite_loss_skips_the_step_and_keeps_the_adapter(tiny_spec):
    backend = make_backend(tiny_spec)
    rollouts = sample(backend)
    batch = batch_for(rollouts)
    row, column = batch.rollouts.completion_mask.nonzero()[0].tolist()
    batch.advantages[row, column] = float("nan")
    before = lora_state(backend)
    result = backend.train(batch)
    assert result.skipped_nonfinite and result.update is None
    assert backend.optimizer.state_dict()["state"] == {}
    assert backend.weights_version == 0
    after = lora_state(backend)
    assert all(torch.equal(before[name], after[name]) for name in before)
    assert all(p.grad is None for p in backend.trainable)

    healthy = backend.train(batch_for(rollouts))
    assert not healthy.skipped_nonfinite and backend.weights_version == healthy.update.version == 1


def test_lora_trains_and_only_lora_changes(tiny_spec):
    backend = make_backend(tiny_spec, lr=5e-2)
    frozen = {name: p.detach().clone() for name, p in backend.model.named_parameters() if "lora_" not in name}
    adapter = lora_state(backend)
    rollouts = sample(backend)
    batch = batch_for(rollouts)
    losses = [backend.train(batch).loss for _ in range(3)]  # same samples: ratios move away from 1
    assert len(set(losses)) == 3
    changed = [name for name, p in lora_state(backend).items() if not torch.equal(p, adapter[name])]
    assert changed and any("lora_B" in name for name in changed)
    assert all(torch.equal(p, frozen[name]) for name, p in backend.model.named_parameters() if name in frozen)


def test_same_seed_gives_bit_identical_losses(tiny_spec):
    runs = []
    for _ in range(2):
        backend = make_backend(tiny_spec, seed=3)
        runs.append([backend.train(batch_for(sample(backend, seed=step), seed=step)).loss for step in range(2)])
    assert runs[0] == runs[1]


def test_save_load_round_trip_restores_adapter_and_optimizer(tiny_spec, tmp_path):
    original = make_backend(tiny_spec, seed=0)
    for step in range(2):
        original.train(batch_for(sample(original, seed=step), seed=step))
    original.save(tmp_path / "ckpt")
    assert {"adapter_model.safetensors", "adapter_config.json", "optimizer.pt"} <= {
        p.name for p in (tmp_path / "ckpt").iterdir()
    }
    saved_adapter = lora_state(original)
    continued = original.train(batch_for(sample(original, seed=2), seed=2))

    restored = make_backend(tiny_spec, seed=99)  # another LoRA init: everything must come from the checkpoint
    update = restored.load(tmp_path / "ckpt")
    assert update.version == restored.weights_version == 2  # the optimizer steps the checkpoint had taken
    assert all(torch.equal(p, saved_adapter[name]) for name, p in lora_state(restored).items())
    resumed = restored.train(batch_for(sample(restored, seed=2), seed=2))
    assert resumed.loss == continued.loss
    assert resumed.grad_norm == continued.grad_norm
    assert all(torch.equal(p, lora_state(original)[name]) for name, p in lora_state(restored).items())


def test_load_rejects_an_adapter_of_another_rank(tiny_spec, tmp_path):
    make_backend(tiny_spec).save(tmp_path / "rank4")
    tiny_spec.lora_rank = 8
    with pytest.raises(ValueError, match="lora_rank"):
        make_backend(tiny_spec).load(tmp_path / "rank4")


def test_batch_without_contributing_tokens_takes_no_step(tiny_spec):
    backend = make_backend(tiny_spec)
    rollouts = sample(backend)
    before = lora_state(backend)
    result = backend.train(
        TrainBatch(
            rollouts, torch.zeros(rollouts.completion_ids.shape), torch.ones(rollouts.num_rows, dtype=torch.bool)
        )
    )
    assert result.num_tokens == 0 and not result.skipped_nonfinite
    assert all(torch.equal(p, before[name]) for name, p in lora_state(backend).items())


def test_gradient_checkpointing_keeps_the_gradient(tiny_spec):
    """...through the switch the installed transformers has, without its FutureWarning about the old one."""
    results = []
    for checkpointing in (False, True):
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            backend = make_backend(tiny_spec, gradient_checkpointing=checkpointing)
            assert any(getattr(m, "gradient_checkpointing", False) for m in backend.model.modules()) == checkpointing
            results.append(backend.train(batch_for(sample(backend))))
    assert results[0].loss == pytest.approx(results[1].loss, abs=1e-6)
    assert results[0].grad_norm == pytest.approx(results[1].grad_norm, rel=1e-5)


def test_a_step_reports_the_padding_its_forwards_computed(tiny_spec, monkeypatch):
    """train/padding_frac, checked where the layout is simplest: under activation checkpointing (no prompt cache),
    groups not packed, every row runs its prompt and completion in one forward, padded to the longest of each (the
    step's log-prob passes alike)."""
    monkeypatch.setattr(packing_module, "PACKED_SCORE_RATIO", 0)
    backend = make_backend(tiny_spec, gradient_checkpointing=True)
    rollouts = sample(backend)
    result = backend.train(batch_for(rollouts))
    prompt_lengths = rollouts.prompt_mask.sum(dim=1).repeat_interleave(rollouts.group_size)
    completion_lengths = rollouts.completion_mask.sum(dim=1)
    real = int(prompt_lengths.sum() + completion_lengths.sum())
    computed = rollouts.num_rows * (int(prompt_lengths.max()) + int(completion_lengths.max()))
    assert result.metrics["train/padding_frac"] == pytest.approx(1 - real / computed)
    assert 0 < result.metrics["train/padding_frac"] < 1


class TestPolicyTokenLoss:
    ratios = torch.tensor([0.5, 0.9, 1.0, 1.1, 1.5, 0.5, 1.5])
    advantages = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, -1.0, -1.0])

    def loss(self, settings: LossSettings):
        new = torch.log(self.ratios)
        return policy_token_loss(new, torch.zeros_like(new), self.advantages, settings)

    def test_pure_importance_sampling(self):
        result = self.loss(LossSettings(clip_eps=0.0, clip_eps_high=None))
        torch.testing.assert_close(result.loss, -self.ratios * self.advantages)
        assert not result.clipped.any()

    def test_clip_and_clip_higher(self):
        symmetric = self.loss(LossSettings(clip_eps=0.2, clip_eps_high=None))
        # A > 0 clips above 1.2; A < 0 clips below 0.8.
        torch.testing.assert_close(symmetric.loss, -torch.tensor([0.5, 0.9, 1.0, 1.1, 1.2, -0.8, -1.5]))
        assert symmetric.clipped.tolist() == [False, False, False, False, True, True, False]
        higher = self.loss(LossSettings(clip_eps=0.2, clip_eps_high=0.6))
        torch.testing.assert_close(higher.loss, -torch.tensor([0.5, 0.9, 1.0, 1.1, 1.5, -0.8, -1.5]))

    def test_gradient_flows_through_unclipped_tokens_only(self):
        new = torch.log(self.ratios).requires_grad_()
        policy_token_loss(
            new, torch.zeros(7), self.advantages, LossSettings(clip_eps=0.2, clip_eps_high=None)
        ).loss.sum().backward()
        assert (new.grad == 0).tolist() == [False, False, False, False, True, True, False]


def test_clipped_loss_reports_clip_fraction(tiny_spec):
    backend = make_backend(tiny_spec, lr=0.2, loss=LossSettings(clip_eps=0.01, clip_eps_high=None))
    batch = batch_for(sample(backend))
    first = backend.train(batch)
    second = backend.train(batch)  # stale samples after a large step: ratios leave [0.99, 1.01]
    assert first.metrics["policy/clip_frac"] == 0.0
    assert 0 < second.metrics["policy/clip_frac"] <= 1
