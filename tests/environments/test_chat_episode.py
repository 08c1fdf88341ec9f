"""An agent episode's chat completions calls, through the official `openai` client, recorded as one token row."""

from __future__ import annotations

import copy

import openai
import pytest

from retrain.environments.chat_episode import ChatEpisode
from retrain.environments.example_agent import TOOLS
from retrain.inference.completions import request_seed
from retrain.inference.endpoint import EngineEndpoint
from retrain.inference.requests import completions_of
from retrain.types import SamplingParams
from tests.backend.tiny_model import make_backend, make_engine, tokenizer_of

SAMPLING = SamplingParams(max_tokens=6, temperature=1.0)


@pytest.fixture
def served(tiny_spec):
    engine = make_engine(make_backend(tiny_spec))
    endpoint = EngineEndpoint(engine, max_model_len=128)
    yield endpoint, engine, tokenizer_of(tiny_spec.name_or_path)
    endpoint.close()


def episode_of(served, seed: int = 3) -> tuple[ChatEpisode, openai.OpenAI]:
    endpoint, _, tokenizer = served
    episode = ChatEpisode(tokenizer, SAMPLING, seed, endpoint.complete, endpoint.max_model_len)
    client = openai.OpenAI(base_url=endpoint.serve_episode("e1", episode), api_key="unused", max_retries=0)
    return episode, client


def test_two_calls_with_tools_make_one_row_of_exact_tokens(served):
    _, engine, tokenizer = served
    episode, client = episode_of(served)
    messages: list[dict] = [{"role": "user", "content": "What is 12+35?"}]
    first = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
    assert first.choices[0].finish_reason in ("stop", "length") and first.usage.prompt_tokens == 33
    messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "tool", "content": "47"}]
    second = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=4)
    assert second.usage.completion_tokens <= 4  # the request's max_tokens lowers the run's
    assert episode.answer == second.choices[0].message.content

    row = episode.trajectory(reward=1.0)
    prompt = tokenizer.apply_chat_template(messages[:1], add_generation_prompt=True, tokenize=False)
    assert row.prompt_ids == tokenizer.encode(prompt, add_special_tokens=False)
    # the row is the conversation the template renders, with the model's replies exactly as sampled
    replies = [first.choices[0].message.content, second.choices[0].message.content]
    so_far = tokenizer.apply_chat_template(
        [messages[0], {"role": "assistant", "content": replies[0]}, messages[2]],
        add_generation_prompt=True,
        tokenize=False,
    )
    text = tokenizer.decode(row.prompt_ids + row.completion_ids)
    assert text.startswith(so_far) and text[len(so_far) :].removesuffix("<|im_end|>") == replies[1]
    # the model's tokens are sampled (with their log-probs), the rest is context with log-prob 0
    calls = []
    for k, length in enumerate((first.usage.prompt_tokens, second.usage.prompt_tokens)):
        prompt_ids = (row.prompt_ids + row.completion_ids)[:length]
        sampling = SamplingParams(max_tokens=6 if k == 0 else 4, temperature=1.0)
        calls.append(completions_of(engine.generate([prompt_ids], 1, sampling, request_seed(3, k)))[0])
    start = len(row.prompt_ids)
    first_span = slice(0, len(calls[0].token_ids))
    second_span = slice(second.usage.prompt_tokens - start, None)
    assert (
        row.completion_ids[first_span] == calls[0].token_ids and row.completion_ids[second_span] == calls[1].token_ids
    )
    assert row.sampled == [
        start + i < first.usage.prompt_tokens + len(calls[0].token_ids) or start + i >= second.usage.prompt_tokens
        for i in range(len(row.completion_ids))
    ]
    assert row.logprobs[second_span] == pytest.approx(calls[1].logprobs, abs=1e-5)
    assert all(value == 0.0 for value, sampled in zip(row.logprobs, row.sampled) if not sampled)
    assert row.reward == 1.0


def test_an_episode_that_rewrites_its_history_is_refused(served):
    episode, client = episode_of(served)
    messages: list[dict] = [{"role": "user", "content": "What is 7+8?"}]
    reply = client.chat.completions.create(model="policy", messages=messages).choices[0].message
    edited = [
        {"role": "user", "content": "What is 8+7?"},
        reply.model_dump(exclude_none=True),
        {"role": "user", "content": "?"},
    ]
    with pytest.raises(openai.BadRequestError, match="does not extend the conversation"):
        client.chat.completions.create(model="policy", messages=edited)
    with pytest.raises(openai.BadRequestError, match="does not extend"):  # and stays refused
        client.chat.completions.create(model="policy", messages=[*messages, reply.model_dump(), edited[-1]])
    assert episode.trajectory(reward=1.0).reward is None


def test_an_episode_that_changes_its_tools_is_refused(served):
    episode, client = episode_of(served)
    messages: list[dict] = [{"role": "user", "content": "What is 7+8?"}]
    reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS).choices[0].message
    messages += [reply.model_dump(exclude_none=True), {"role": "user", "content": "?"}]
    with pytest.raises(openai.BadRequestError, match="offers other tools than call 1"):
        client.chat.completions.create(model="policy", messages=messages)
    assert episode.refused is not None


def test_malformed_requests_and_ended_episodes_are_answered_not_sampled(served):
    endpoint, _, _ = served
    episode, client = episode_of(served)
    for bad, message in [
        ({"messages": []}, "non-empty list"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "role among"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "hi"}], "n": 2}, "n must be 1"),
        ({"messages": [{"role": "user", "content": "hi"}], "tools": ["add"]}, "tools must be"),
    ]:
        with pytest.raises(openai.BadRequestError, match=message):
            client.chat.completions.create(model="policy", **bad)
    long = [{"role": "user", "content": "x" * 200}]
    with pytest.raises(openai.BadRequestError, match="whole context"):
        client.chat.completions.create(model="policy", messages=long)
    assert episode.calls == 0
    endpoint.end_episode("e1")
    with pytest.raises(openai.NotFoundError, match="not in flight"):
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])


def test_a_template_that_rewrites_earlier_turns_keeps_the_tokens_the_model_sampled(served):
    """Like Qwen3's, this template writes a reasoning block into the last assistant turn only: once a later turn
    follows, the template would render the reply differently, but the row (and the next prompt) keeps the reply's
    tokens as sampled and appends only what follows it."""
    endpoint, _, tokenizer = served
    rewriting = copy.deepcopy(tokenizer)
    rewriting.chat_template = (
        "{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
        "{%- if message['role'] == 'assistant' and loop.last %}{{ '<think></think>' }}{%- endif %}"
        "{{ message['content'] + '<|im_end|>\\n' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
    )
    episode = ChatEpisode(rewriting, SAMPLING, 5, endpoint.complete, endpoint.max_model_len)
    client = openai.OpenAI(base_url=endpoint.serve_episode("e2", episode), api_key="unused", max_retries=0)
    messages: list[dict] = [{"role": "user", "content": "What is 1+2?"}]
    reply = client.chat.completions.create(model="policy", messages=messages).choices[0]
    first_row = list(episode.tokens)
    messages += [reply.message.model_dump(exclude_none=True), {"role": "user", "content": "Sure?"}]
    second = client.chat.completions.create(model="policy", messages=messages)
    row = episode.trajectory(reward=0.0)
    tokens = row.prompt_ids + row.completion_ids
    assert tokens[: len(first_row)] == first_row  # the first call's prompt and its sampled reply, unchanged
    closing = "" if reply.finish_reason == "stop" else "<|im_end|>"
    bridge = tokenizer.encode(closing + "\n<|im_start|>user\nSure?<|im_end|>\n<|im_start|>assistant\n")
    assert tokens[len(first_row) : second.usage.prompt_tokens] == bridge
