"""Agents for data=agent tests: each misbehaves in one way, chosen by its task's `fault` field."""

from __future__ import annotations

import threading

from openai import OpenAI

RELEASE = threading.Event()  # a hung agent blocks on it (set by the test once the step is over)


def faulty(task: dict, base_url: str, model: str) -> float:
    """A synchronous agent: one call, then the task's fault (or none)."""
    fault = task["fault"]
    if fault == "silent":
        return 1.0  # never called the model
    with OpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": task["question"]}])
    if fault == "raise":
        raise ValueError("the agent's own bug")
    if fault == "hang":
        RELEASE.wait()
    if fault == "nan":
        return float("nan")
    return 1.0


def always_raises(task: dict, base_url: str, model: str) -> float:
    raise RuntimeError("no luck")


async def branching(task: dict, base_url: str, model: str) -> float:
    """Two calls, the second with the first user message rewritten: the episode branches."""
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
        messages = [{"role": "user", "content": task["question"]}]
        reply = (await client.chat.completions.create(model=model, messages=messages)).choices[0].message
        rewritten = [{"role": "user", "content": "Again: " + task["question"]}, reply.model_dump(exclude_none=True)]
        await client.chat.completions.create(model=model, messages=[*rewritten, {"role": "user", "content": "?"}])
    return 1.0


def returns_a_coroutine(task: dict, base_url: str, model: str):
    """A plain function that hands back a coroutine (e.g. a wrapper around an async agent): awaited like one."""
    from retrain.environments.example_agent import run_episode

    return run_episode(task, base_url, model)
