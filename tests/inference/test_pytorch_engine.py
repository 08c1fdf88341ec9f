"""The in-process PyTorch engine, on the backend's real tiny model (shared, not copied)."""

from __future__ import annotations

import pytest
import torch

from retrain.inference.config import PytorchEngineConfig
from retrain.inference.pytorch import PytorchEngine
from retrain.inference.requests import TokenRequest, completions_of
from retrain.inference.sampler.tokens import draw
from retrain.model.logprobs import left_pad
from retrain.model.probe import StaleWeightsError
from retrain.model.resources import EngineResources
from retrain.model.rows import positions_from_mask
from retrain.types import SamplingParams, WeightUpdate
from tests.backend.tiny_model import PROMPTS, encode, make_backend, make_engine, tokenizer_of


@pytest.fixture
def backend(tiny_spec):
    return make_backend(tiny_spec)


@pytest.fixture
def engine(backend):
    return make_engine(backend)


@pytest.fixture
def prompt_ids(backend):
    return encode(backend, PROMPTS)


def full_forward_logits(backend, rollouts, rows: torch.Tensor) -> torch.Tensor:
    """[R, T, V] logits for every completion position, from one plain forward (no KV cache)."""
    group = rollouts.group_size
    prompts, prompt_mask = rollouts.prompt_ids[rows // group], rollouts.prompt_mask[rows // group]
    ids = torch.cat([prompts, rollouts.completion_ids[rows]], dim=1)
    mask = torch.cat([prompt_mask, rollouts.completion_mask[rows]], dim=1)
    with torch.no_grad():
        logits = backend.model(input_ids=ids, attention_mask=mask.long(), position_ids=positions_from_mask(mask)).logits
    width = rollouts.completion_ids.shape[1]
    return logits[:, prompts.shape[1] - 1 : prompts.shape[1] - 1 + width]


def test_greedy_is_the_argmax_of_a_plain_forward(backend, engine, prompt_ids):
    greedy = SamplingParams(max_tokens=6, temperature=0.0, top_p=1.0)
    rollouts = engine.generate(prompt_ids, 2, greedy, generator_seed=None)
    assert torch.equal(rollouts.completion_ids[0::2], rollouts.completion_ids[1::2])
    for b, prompt in enumerate(prompt_ids):
        sequence = list(prompt)
        expected = []
        for _ in range(greedy.max_tokens):
            with torch.no_grad():
                token = int(backend.model(input_ids=torch.tensor([sequence])).logits[0, -1].argmax())
            expected.append(token)
            sequence.append(token)
            if token in engine.eos_ids.tolist():
                break
        row = 2 * b
        assert rollouts.completion_ids[row][rollouts.completion_mask[row]].tolist() == expected


def test_logprobs_and_entropies_come_from_the_sampled_distribution(backend, engine, prompt_ids):
    sampling = SamplingParams(max_tokens=6, temperature=0.7, top_p=0.9, return_entropies=True)
    rollouts = engine.generate(prompt_ids, 3, sampling, generator_seed=4)
    rows = torch.arange(rollouts.num_rows)
    logp = torch.log_softmax(full_forward_logits(backend, rollouts, rows) / sampling.temperature, dim=-1)
    mask = rollouts.completion_mask
    expected_logprobs = logp.gather(-1, rollouts.completion_ids.unsqueeze(-1)).squeeze(-1)
    expected_entropies = -(logp.exp() * logp).sum(-1)
    torch.testing.assert_close(rollouts.logprobs[mask], expected_logprobs[mask], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rollouts.entropies[mask], expected_entropies[mask], atol=1e-5, rtol=1e-5)
    assert (rollouts.logprobs[~mask] == 0).all() and (rollouts.entropies[~mask] == 0).all()


def test_same_seed_same_rollouts_other_seed_other_rollouts(engine, prompt_ids):
    sampling = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.95, return_entropies=True)
    first, again, other = (engine.generate(prompt_ids, 4, sampling, seed) for seed in (11, 11, 12))
    for field in ("completion_ids", "completion_mask", "logprobs", "entropies", "hit_max_tokens"):
        assert torch.equal(getattr(first, field), getattr(again, field)), field
    assert first.texts == again.texts
    assert not torch.equal(first.completion_ids, other.completion_ids)


def test_rows_stop_at_eos_or_max_tokens(backend, engine, prompt_ids):
    free = engine.generate(prompt_ids, 8, SamplingParams(max_tokens=6, temperature=1.0), generator_seed=0)
    # The first step at which rows differ; before it every row sampled the same (non-EOS) tokens.
    ids = free.completion_ids
    split = next(step for step in range(ids.shape[1]) if (ids[:, step] != ids[0, step]).any())
    column = ids[:, split]
    candidates = column[~torch.isin(column, engine.eos_ids)]
    stop_token = int(candidates.mode().values)
    assert stop_token not in ids[0, :split].tolist()
    # Declare that token an end-of-turn token, as a chat model's generation config does for
    # <|im_end|>. Resampling with the same seed repeats the steps up to `split`, so exactly the rows
    # that sampled it there stop; the others stop at a real EOS or run to max_tokens.
    backend.model.generation_config.eos_token_id = [stop_token]
    engine = make_engine(backend)
    sampling = SamplingParams(max_tokens=split + 2, temperature=1.0)
    rollouts = engine.generate(prompt_ids, 8, sampling, generator_seed=0)

    assert torch.equal(rollouts.completion_ids[:, : split + 1], ids[:, : split + 1])
    lengths = rollouts.completion_mask.sum(dim=1)
    assert torch.equal(lengths == split + 1, torch.isin(column, engine.eos_ids))
    eos = set(engine.eos_ids.tolist())
    for row in range(rollouts.num_rows):
        tokens = rollouts.completion_ids[row, : lengths[row]].tolist()
        assert rollouts.completion_mask[row, : lengths[row]].all()  # right-padded
        if rollouts.hit_max_tokens[row]:
            assert len(tokens) == sampling.max_tokens and not eos & set(tokens)
        else:
            assert tokens[-1] in eos and not eos & set(tokens[:-1])
    assert rollouts.hit_max_tokens.any() and not rollouts.hit_max_tokens.all()
    assert rollouts.completion_ids.shape[1] == int(lengths.max())
    assert (rollouts.completion_ids[~rollouts.completion_mask] == engine.tokenizer.pad_token_id).all()


def test_everything_stops_at_the_first_eos(backend, engine, prompt_ids):
    greedy = SamplingParams(max_tokens=5, temperature=0.0, top_p=1.0)
    first_token = engine.generate(prompt_ids[:1], 1, greedy, None).completion_ids[0, 0]
    backend.model.generation_config.eos_token_id = [int(first_token)]
    rollouts = make_engine(backend).generate(prompt_ids[:1], 3, greedy, None)
    assert rollouts.completion_ids.shape == (3, 1) and not rollouts.hit_max_tokens.any()


def test_texts_decode_the_completions(engine, prompt_ids):
    rollouts = engine.generate(prompt_ids, 2, SamplingParams(max_tokens=6, temperature=1.0), 3)
    for row, text in enumerate(rollouts.texts):
        tokens = rollouts.completion_ids[row][rollouts.completion_mask[row]].tolist()
        assert text == engine.tokenizer.decode(tokens, skip_special_tokens=True)


def test_tiny_top_p_keeps_only_the_top_token(engine, prompt_ids):
    greedy = engine.generate(prompt_ids, 2, SamplingParams(max_tokens=5, temperature=0.0), None)
    nucleus = engine.generate(prompt_ids, 2, SamplingParams(max_tokens=5, temperature=1.0, top_p=1e-6), 9)
    assert torch.equal(greedy.completion_ids, nucleus.completion_ids)
    assert 0 < nucleus.metrics["policy/top_p_mass"] < 1 and nucleus.temperature == 1.0


def test_prefix_caching_does_not_change_what_is_sampled(backend, prompt_ids):
    sampling = SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9)
    shared, separate = make_engine(backend, prefix_caching=True), make_engine(backend, prefix_caching=False)
    cached, uncached = (engine.generate(prompt_ids, 4, sampling, 5) for engine in (shared, separate))
    assert torch.equal(cached.completion_ids, uncached.completion_ids)
    torch.testing.assert_close(cached.logprobs, uncached.logprobs, atol=1e-5, rtol=1e-5)


def test_sync_to_the_shared_model_copies_nothing_and_refuses_going_back(backend, engine):
    before = {name: p.detach().clone() for name, p in backend.model.named_parameters()}
    engine.sync(WeightUpdate(version=3, tensors=backend.adapter))
    assert engine.weights_version == 3
    assert all(torch.equal(p, before[name]) for name, p in backend.model.named_parameters())
    with pytest.raises(StaleWeightsError, match="version 2"):
        engine.sync(WeightUpdate(version=2, tensors=backend.adapter))


def test_sync_names_the_parameters_the_model_lacks_and_keeps_its_version(backend, engine):
    stray = {"base_model.model.no_such_layer.lora_A.default.weight": torch.zeros(2, 2), **backend.adapter}
    with pytest.raises(ValueError, match="no_such_layer"):
        engine.sync(WeightUpdate(version=1, tensors=stray))
    assert engine.weights_version == 0


def test_sync_loads_named_tensors_and_adapter_dirs_into_a_model_of_its_own(tiny_spec, tmp_path):
    trained = make_backend(tiny_spec, seed=0)
    with torch.no_grad():
        for tensor in trained.adapter.values():
            tensor.normal_(generator=torch.Generator().manual_seed(1))
    for update in (WeightUpdate(version=1, tensors=trained.adapter), WeightUpdate(version=1, adapter_dir=tmp_path)):
        trained.save(tmp_path)
        own_model = make_backend(tiny_spec, seed=5).model
        engine = PytorchEngine(
            PytorchEngineConfig(),
            tokenizer=tokenizer_of(tiny_spec.name_or_path),
            resources=EngineResources(spec=tiny_spec, device=trained.device, model=own_model),
        )
        engine.sync(update)
        served = dict(own_model.named_parameters())
        assert all(torch.equal(served[name], tensor) for name, tensor in trained.adapter.items())
        assert all(served[name] is not tensor for name, tensor in trained.adapter.items())


def test_an_engine_needs_a_model_to_sample_with(tiny_spec):
    backend = make_backend(tiny_spec)
    shares_none = EngineResources(spec=tiny_spec, device=backend.device, model=None)
    with pytest.raises(ValueError, match="inference=pytorch samples in-process"):
        PytorchEngine(PytorchEngineConfig(), tokenizer=tokenizer_of(tiny_spec.name_or_path), resources=shares_none)


@pytest.mark.parametrize(
    ("sampling", "group_size", "message"),
    [
        (SamplingParams(max_tokens=0), 2, "max_tokens"),
        (SamplingParams(max_tokens=4, temperature=-1.0), 2, "temperature"),
        (SamplingParams(max_tokens=4, top_p=0.0), 2, "top_p"),
        (SamplingParams(max_tokens=4), 0, "group_size"),
    ],
)
def test_bad_sampling_parameters_are_named(engine, prompt_ids, sampling, group_size, message):
    with pytest.raises(ValueError, match=message):
        engine.generate(prompt_ids, group_size, sampling, 0)


def test_left_pad_rejects_empty_prompts():
    ids, mask = left_pad([[5, 6], [7]], pad_id=0, device=torch.device("cpu"))
    assert ids.tolist() == [[5, 6], [0, 7]] and mask.tolist() == [[True, True], [False, True]]
    with pytest.raises(ValueError, match="positions \\[1\\]"):
        left_pad([[5], []], pad_id=0, device=torch.device("cpu"))


def test_draw_follows_the_weights_and_never_picks_a_zero_weight():
    weights = torch.tensor([[0.0, 1.0, 0.0, 3.0, 0.0], [2.0, 0.0, 0.0, 0.0, 2.0], [0.0, 0.0, 0.0, 0.0, 5.0]])
    rows = weights.repeat(20000, 1)
    drawn = draw(rows, torch.rand(rows.shape[0], generator=torch.Generator().manual_seed(0))).view(20000, 3)
    for row, expected in enumerate(weights / weights.sum(dim=1, keepdim=True)):
        share = torch.bincount(drawn[:, row], minlength=5) / 20000
        assert torch.allclose(share, expected, atol=0.015), (row, share)
        assert share[expected == 0].sum() == 0


def test_draw_inverts_the_cdf_at_the_edges_of_the_unit_interval():
    weights = torch.tensor([[0.0, 1.0, 1.0, 0.0], [0.0, 1.0, 1.0, 0.0]])
    assert draw(weights, torch.tensor([0.0, 1.0 - 2**-24])).tolist() == [1, 2]


def test_requests_sampled_together_draw_what_each_draws_alone(engine, prompt_ids):
    """The endpoint's batches: each request's tokens depend on its own seed and max_tokens, not on its batch."""
    requests = [
        TokenRequest(prompt_ids[n % len(prompt_ids)], SamplingParams(max_tokens=3 + n, temperature=1.0), seed)
        for n, seed in enumerate([5, 9, 5, 1234, 77, 3])
    ]
    together = engine.generate_requests(requests)
    for request, completion in zip(requests, together, strict=True):
        (alone,) = completions_of(engine.generate([request.prompt_ids], 1, request.sampling, request.seed))
        assert completion.token_ids == alone.token_ids
        assert completion.hit_max_tokens == alone.hit_max_tokens
        assert torch.allclose(torch.tensor(completion.logprobs), torch.tensor(alone.logprobs), atol=1e-5)
        assert len(completion.token_ids) <= request.sampling.max_tokens
    assert any(c.hit_max_tokens and len(c.token_ids) == r.sampling.max_tokens for r, c in zip(requests, together))


def test_a_batch_of_requests_shares_temperature_and_top_p(engine, prompt_ids):
    hot, cold = SamplingParams(max_tokens=2, temperature=1.0), SamplingParams(max_tokens=2, temperature=0.5)
    with pytest.raises(ValueError, match="share temperature and top_p"):
        engine.generate_requests([TokenRequest(prompt_ids[0], hot, 1), TokenRequest(prompt_ids[1], cold, 1)])


def test_each_request_is_answered_as_its_row_finishes(engine, prompt_ids):
    """The endpoint answers a short request while the long ones of its batch still decode."""
    requests = [TokenRequest(prompt_ids[0], SamplingParams(max_tokens=n, temperature=1.0), 4) for n in (12, 1, 6)]
    answered: list[tuple[int, object]] = []
    completions = engine.generate_requests(requests, lambda index, completion: answered.append((index, completion)))
    assert answered[0] == (1, completions[1])  # one token: done at the first step
    assert sorted(answered, key=lambda pair: pair[0]) == list(enumerate(completions))


@pytest.mark.parametrize("stop_check_steps", [1, 8])
def test_requests_that_arrive_join_the_running_batch_and_draw_what_they_draw_alone(
    backend, prompt_ids, stop_check_steps
):
    """Continuous admission: requests handed over while a batch decodes join it, if they fit (same temperature and
    top_p, max_tokens within the call's), and sample exactly what they sample alone. Rows that arrive join at once,
    even while the stop flags are read once per 8 steps (they end the window)."""
    engine = make_engine(backend, stop_check_steps=stop_check_steps)
    hot = SamplingParams(max_tokens=10, temperature=1.0)
    first = TokenRequest(prompt_ids[0], hot, 4)
    later = [
        TokenRequest(prompt_ids[1], SamplingParams(max_tokens=5, temperature=1.0), 8),
        TokenRequest(prompt_ids[2] + prompt_ids[3], hot, None),  # a longer prompt than the batch's; a drawn seed
    ]
    misfits = [
        TokenRequest(prompt_ids[1], SamplingParams(max_tokens=5, temperature=0.5), 1),  # another temperature
        TokenRequest(prompt_ids[1], SamplingParams(max_tokens=11, temperature=1.0), 1),  # more than the call's
    ]
    asked = 0
    left: list[TokenRequest] = []
    answered_at: dict[int, int] = {}  # request -> how many times `more` had been asked when it was answered

    def more(fits) -> list[TokenRequest]:
        nonlocal asked
        asked += 1
        if asked != 3:  # the batch has run two decode steps when they arrive
            return []
        left.extend(request for request in misfits if not fits(request))
        return [request for request in later if fits(request)]

    completions = engine.generate_requests([first], lambda index, _: answered_at.setdefault(index, asked), more)
    assert len(completions) == 3 and left == misfits
    assert len(completions[0].token_ids) > 2 and answered_at[0] > 3  # the first still decoded when the others joined
    assert sorted(answered_at) == [0, 1, 2]
    for request, completion in zip([first, later[0]], completions, strict=False):
        (alone,) = completions_of(engine.generate([request.prompt_ids], 1, request.sampling, request.seed))
        assert completion.token_ids == alone.token_ids
        assert torch.allclose(torch.tensor(completion.logprobs), torch.tensor(alone.logprobs), atol=1e-5)
    assert len(completions[1].token_ids) <= 5 and 1 <= len(completions[2].token_ids) <= 10
