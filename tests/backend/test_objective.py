"""The objectives of retrain/objective (docs/loss.md), each against its paper's formula computed by hand on a
3-row case; the loss aggregations; the entropy bonus from the chunked head; and their exactness across
token micro-batches on the tiny model."""

from __future__ import annotations

import math

import pytest
import torch

import retrain.model.logprobs as logprobs_module
from retrain.backend.settings import LossSettings
from retrain.config import TrainingConfig
from retrain.errors import ConfigError
from retrain.model.logprobs import completion_logprobs, completion_logprobs_and_entropy
from retrain.model.rows import positions_from_mask
from retrain.objective.aggregation import aggregation
from retrain.objective.policy import policy_token_loss
from tests.backend.test_local_training import step_with_gradient
from tests.backend.tiny_model import make_backend
from tests.inference.test_logits_chunks import (
    TEMPERATURE,
    TOKENS_PER_CHUNK,
    logprobs_and_gradient,
    tiny_rows,
    with_nonzero_adapter,
)

# three rows of at most two tokens; row 2 has one real token
NEW = torch.log(torch.tensor([[0.5, 0.4], [0.6, 0.5], [0.5, 1.0]]))
OLD = torch.log(torch.tensor([[0.5, 0.5], [0.5, 0.5], [0.5, 1.0]]))
ADVANTAGES = torch.tensor([[1.0, 3.0], [1.0, 1.0], [-2.0, 0.0]])
MASK = torch.tensor([[True, True], [True, True], [True, False]])


def loss_and_gradient(settings: LossSettings, new=NEW, old=OLD, advantages=ADVANTAGES) -> tuple[float, torch.Tensor]:
    """The step's loss L and dL/d(new log-probs), with the settings' aggregation, on one rank."""
    new = new.clone().requires_grad_()
    token_loss = policy_token_loss(new, old, advantages, settings, mask=MASK)
    agg = aggregation(settings.loss_agg, MASK, settings.loss_agg_constant, lambda count: count)
    loss = (token_loss.loss * agg.weights).sum() / agg.divisor
    loss.backward()
    assert new.grad is not None
    return float(loss.detach()), new.grad


def paper_settings(objective: str) -> LossSettings:
    return LossSettings.from_config(TrainingConfig(objective=objective))


def test_the_objectives_take_their_papers_defaults() -> None:
    gspo, cispo, ppo = paper_settings("gspo"), paper_settings("cispo"), LossSettings.from_config(TrainingConfig())
    assert (gspo.clip_eps, gspo.upper_eps, gspo.loss_agg) == (3e-4, 4e-4, "seq_mean_token_mean")
    assert (cispo.clip_eps, cispo.upper_eps, cispo.loss_agg) == (1.0, 0.28, "token_mean")
    assert (ppo.objective, ppo.clip_eps, ppo.clip_eps_high, ppo.loss_agg) == ("ppo", 0.0, None, "token_mean")
    explicit = LossSettings.from_config(TrainingConfig(objective="gspo", clip_eps=0.01, loss_agg="token_mean"))
    assert (explicit.clip_eps, explicit.upper_eps, explicit.loss_agg) == (0.01, 0.01, "token_mean")


def test_gspo_by_hand() -> None:
    """Zheng et al. 2025: s_i = exp(1/|y_i| Σ_t log(π/π_old)), loss −1/G Σ_i min(s_i·A, clip(s_i, 1−3e-4, 1+4e-4)·A),
    here with A per token (1/|y_i| Σ_t of the per-token terms)."""
    s0, s1 = math.sqrt(0.8), math.sqrt(1.2)  # row 0: below 1 with A > 0 (not clipped); row 1: above 1 + 4e-4, clipped
    # row 2: s = 1, A = −2 on its one token
    expected = (0.5 * (-s0 * 1 - s0 * 3) + 0.5 * (-(1 + 4e-4) * 2) + 2.0) / 3
    loss, gradient = loss_and_gradient(paper_settings("gspo"))
    assert loss == pytest.approx(expected, rel=1e-6) and s1 > 1 + 4e-4
    # row 0's two terms both depend on s0, whose gradient w.r.t. each token's log-prob is s0/2
    row0 = (0.5 * (-1 - 3) * s0 / 2) / 3
    torch.testing.assert_close(gradient, torch.tensor([[row0, row0], [0.0, 0.0], [2 / 3, 0.0]]))


def test_gspo_token_by_hand() -> None:
    """s_i,t = sg[s_i]·π(y_t)/sg[π(y_t)]: the value of GSPO's s_i, each token's gradient its own (token-varying A)."""
    s0, s1 = math.sqrt(0.8), math.sqrt(1.2)
    expected = (0.5 * (-s0 * 1 - s0 * 3) + 0.5 * (-(1 + 4e-4) * 2) + 2.0) / 3
    loss, gradient = loss_and_gradient(paper_settings("gspo_token"))
    assert loss == pytest.approx(expected, rel=1e-6) and s1 > 1 + 4e-4
    torch.testing.assert_close(gradient, torch.tensor([[-s0 / 6, -3 * s0 / 6], [0.0, 0.0], [2 / 3, 0.0]]))


def test_cispo_by_hand() -> None:
    """MiniMax-M1: −1/Σ|o_i| Σ_i Σ_t sg[clip(r, 1−ε_low, 1+ε_high)]·A·log π, no lower bound, ε_high 0.28: the clipped
    token (r = 1.6 → 1.28) keeps its gradient."""
    new = torch.log(torch.tensor([[0.5, 0.4], [0.8, 0.5], [0.5, 1.0]]))
    advantages = torch.tensor([[1.0, 3.0], [1.0, -1.0], [-2.0, 0.0]])
    weights = torch.tensor([[1.0, 0.8], [1.28, 1.0], [1.0, 0.0]])
    expected = float(-(weights * advantages * new).sum() / 5)
    loss, gradient = loss_and_gradient(paper_settings("cispo"), new=new, advantages=advantages)
    assert loss == pytest.approx(expected, rel=1e-6)
    torch.testing.assert_close(gradient, -weights * advantages / 5)
    clipped = policy_token_loss(new, OLD, advantages, paper_settings("cispo"), mask=MASK).clipped
    assert clipped.tolist() == [[False, False], [True, False], [False, False]]


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token_mean", (1 + 2 + 3 + 4) / 4),
        ("seq_mean_token_mean", ((1 + 2 + 3) / 3 + 4 / 1) / 2),
        ("seq_mean_token_sum", ((1 + 2 + 3) + 4) / 2),
        ("seq_sum_norm", (1 + 2 + 3 + 4) / 50),
    ],
)
def test_each_aggregation_by_hand(mode: str, expected: float) -> None:
    """Row 2 has no trained token: it counts in no mean; seq_sum_norm divides by its constant whatever is trained."""
    losses = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0], [9.0, 9.0, 9.0]])
    trained = torch.tensor([[True, True, True], [True, False, False], [False, False, False]])
    agg = aggregation(mode, trained, 50.0, lambda count: count)
    assert float((losses * agg.weights).sum() / agg.divisor) == pytest.approx(expected)


def test_seq_sum_norm_defaults_to_batch_times_group_times_max_tokens() -> None:
    training = TrainingConfig(loss_agg="seq_sum_norm", batch_size=2, group_size=4, max_tokens=100)
    assert LossSettings.from_config(training).loss_agg_constant == 800
    assert (
        LossSettings.from_config(TrainingConfig(loss_agg="seq_sum_norm", loss_agg_constant=7.0)).loss_agg_constant == 7
    )


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"objective": "grpo"}, "training.objective='grpo' is not one of: ppo, gspo, gspo_token, cispo"),
        ({"loss_agg": "sum"}, "training.loss_agg='sum' is not one of: token_mean, seq_mean_token_mean"),
        ({"loss_agg": "seq_sum_norm", "loss_agg_constant": 0.0}, "training.loss_agg_constant must be > 0"),
        ({"entropy_coef": -0.1}, r"training.entropy_coef must be >= 0 \(0 = no entropy term\)"),
    ],
)
def test_a_bad_objective_value_names_its_key(overrides: dict, named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        LossSettings.from_config(TrainingConfig(**overrides))


def test_the_entropy_bonus_subtracts_coef_times_entropy() -> None:
    entropy = torch.tensor([[1.0, 2.0], [0.5, 0.0], [3.0, 0.0]])
    with_bonus = policy_token_loss(NEW, OLD, ADVANTAGES, LossSettings(0.0, None, entropy_coef=0.1), entropy=entropy)
    without = policy_token_loss(NEW, OLD, ADVANTAGES, LossSettings(0.0, None))
    torch.testing.assert_close(with_bonus.loss, without.loss - 0.1 * entropy)
    assert without.entropy is None and torch.equal(with_bonus.entropy, entropy)


def full_logits_entropy(model, rows) -> torch.Tensor:
    """[R, T] entropy of each completion token's tempered distribution from transformers' full logits."""
    prompts, prompt_mask, index, completions, completion_mask = rows
    mask = torch.cat([prompt_mask[index], completion_mask], dim=1)
    output = model(
        input_ids=torch.cat([prompts[index], completions], dim=1),
        attention_mask=mask.long(),
        position_ids=positions_from_mask(mask),
        logits_to_keep=completions.shape[1] + 1,
    )
    logprobs = torch.log_softmax(output.logits[:, :-1].float() / TEMPERATURE, dim=-1)
    return -(logprobs.exp() * logprobs).sum(dim=-1).masked_fill(~completion_mask, 0.0)


def test_entropy_from_the_chunks_is_the_full_distributions_value_and_gradient(tiny_spec, monkeypatch) -> None:
    """Chunks of 3 tokens (the tiny rows' 19 tokens take 7), checkpointed: the entropy and its gradient are those
    of transformers' full logits, and the log-probs beside them completion_logprobs' own."""
    backend = make_backend(tiny_spec)
    model = with_nonzero_adapter(backend.model).train()
    rows = tiny_rows(backend, tiny_spec)
    vocabulary = model.get_output_embeddings().weight.shape[0]
    monkeypatch.setattr(logprobs_module, "LOGITS_CHUNK_BYTES", TOKENS_PER_CHUNK * 4 * vocabulary)
    chunked = logprobs_and_gradient(model, rows, lambda: completion_logprobs_and_entropy(model, *rows, TEMPERATURE)[1])
    reference = logprobs_and_gradient(model, rows, lambda: full_logits_entropy(model, rows))
    torch.testing.assert_close(chunked[0], reference[0], atol=2e-5, rtol=1e-5)
    # H = logsumexp − Σ p·x against −Σ p·log p: the gradients differ by fp32 rounding of sums over the vocabulary
    assert (chunked[1] - reference[1]).norm() <= 1e-4 * reference[1].norm()
    assert chunked[0][rows[4]].min() > 0
    with torch.no_grad():
        logprobs, _ = completion_logprobs_and_entropy(model, *rows, TEMPERATURE)
        torch.testing.assert_close(logprobs, completion_logprobs(model, *rows, TEMPERATURE), atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    "training",
    [
        TrainingConfig(objective="gspo", entropy_coef=0.01),  # seq_mean_token_mean, the paper's
        TrainingConfig(objective="cispo", loss_agg="seq_mean_token_sum"),
        TrainingConfig(objective="gspo_token", loss_agg="seq_sum_norm", clip_eps=0.2, entropy_coef=0.01),
    ],
    ids=["gspo-entropy", "cispo-seq_mean_token_sum", "gspo_token-seq_sum_norm"],
)
def test_token_micro_batches_give_the_one_batch_loss_and_gradient(tiny_spec, training: TrainingConfig) -> None:
    """Each row's weight is its normaliser, known before any micro-batch runs: splitting the rows changes nothing."""
    loss = LossSettings.from_config(training)
    _, one, one_gradient = step_with_gradient(tiny_spec, 0, loss)
    _, split, gradient = step_with_gradient(tiny_spec, 100, loss)
    assert split.loss == pytest.approx(one.loss, rel=1e-5, abs=1e-7) and one.loss != 0
    assert gradient.keys() == one_gradient.keys() and gradient
    for key in gradient:
        torch.testing.assert_close(gradient[key], one_gradient[key], rtol=1e-5, atol=1e-6)  # fp32 rounding
    assert ("policy/entropy" in one.metrics) == (training.entropy_coef > 0)
