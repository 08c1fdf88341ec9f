"""The example agent of docs/agents.md: two turns with a calculator tool, through any OpenAI-compatible base_url.

python -m retrain data=agent data.tasks=tasks.jsonl data.agent=retrain.environments.example_agent:run_episode
"""

import json
from typing import Any

from openai import AsyncOpenAI

TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]


async def run_episode(task: dict, base_url: str, model: str) -> float:
    """Ask the task's question with the tool offered; answer a tool call with its result (anything else with a
    nudge), then reward 1.0 when the second reply is the boxed sum."""
    async with AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
        messages: list[Any] = [{"role": "user", "content": task["question"]}]
        reply = (await client.chat.completions.create(model=model, messages=messages, tools=TOOLS)).choices[0].message
        messages.append(reply.model_dump(exclude_none=True))
        calls = [call for call in reply.tool_calls or [] if call.type == "function"]
        for call in calls:
            arguments = json.loads(call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(arguments["a"] + arguments["b"])})
        if not calls:
            messages.append({"role": "user", "content": "Sure? Answer again."})
        final = (await client.chat.completions.create(model=model, messages=messages, tools=TOOLS)).choices[0].message
    return float((final.content or "").strip() == f"\\boxed{{{task['answer']}}}")
