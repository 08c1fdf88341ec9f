"""A three-turn arithmetic agent with a tool: the multi-turn workload of the agent tests and benchmarks/agents.py.

python -m retrain data=agent data.tasks=tasks.jsonl data.agent=retrain.environments.arithmetic_agent:run_episode

Turn 1 asks `a+b` with the example agent's `add` tool offered; a tool call is answered with its result, anything
else with a nudge. Turn 2 gives the sum. A follow-up ("Minus c?") then asks to subtract `c`, and turn 3's reply is the episode's
answer: reward 1.0 when it is the boxed `a+b-c`. Every episode makes exactly three model calls, whatever the model
writes, so the work per episode is fixed. `write_tasks` generates the tasks from the arithmetic data's problems.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import httpx
from openai import AsyncOpenAI, DefaultAsyncHttpxClient

from retrain.data.arithmetic import PROMPT_TEMPLATE, draw_problems
from retrain.environments.example_agent import TOOLS

# Terse, so that three turns of 8 tokens fit the bundled tiny model's context (128 tokens of a byte-level vocabulary).
NUDGE = "Sure?"
FOLLOW_UP = "Minus {c}?"
TLS = httpx.create_ssl_context()  # once per process: each client loading the CA certificates costs ~50 ms of CPU


async def run_episode(task: dict, base_url: str, model: str) -> float:
    """Three model calls (question, after the tool result or nudge, after the follow-up); reward 1.0 when the last
    reply is the boxed `a+b-c`."""
    async with AsyncOpenAI(
        base_url=base_url, api_key="unused", max_retries=0, http_client=DefaultAsyncHttpxClient(verify=TLS)
    ) as client:
        messages: list[Any] = [{"role": "user", "content": task["question"]}]

        async def turn() -> Any:
            reply = (await client.chat.completions.create(model=model, messages=messages, tools=TOOLS)).choices[0]
            messages.append(reply.message.model_dump(exclude_none=True))
            return reply.message

        first = await turn()
        calls = [call for call in first.tool_calls or [] if call.type == "function"]
        for call in calls:
            arguments = json.loads(call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(arguments["a"] + arguments["b"])})
        if not calls:
            messages.append({"role": "user", "content": NUDGE})
        await turn()
        messages.append({"role": "user", "content": FOLLOW_UP.format(c=task["c"])})
        final = await turn()
    return float((final.content or "").strip() == f"\\boxed{{{task['answer']}}}")


def arithmetic_tasks(count: int, task_seed: int = 0) -> list[dict[str, Any]]:
    """`count` tasks: the arithmetic data's 2-digit additions (the same problems for a task seed), each with a
    subtrahend `c` in 1..9 and the answer `a+b-c`."""
    rng = random.Random(task_seed)
    tasks = []
    for a, b in draw_problems(count, 10, 99, task_seed):
        c = rng.randint(1, 9)
        tasks.append({"question": PROMPT_TEMPLATE.format(a=a, b=b), "c": c, "answer": str(a + b - c)})
    return tasks


def write_tasks(path: Path, count: int, task_seed: int = 0) -> Path:
    """`arithmetic_tasks(count, task_seed)` as a jsonl file for `data.tasks`."""
    path.write_text("".join(json.dumps(task) + "\n" for task in arithmetic_tasks(count, task_seed)))
    return path
