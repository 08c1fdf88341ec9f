"""Tool calls out of a completion's text, in the OpenAI chat format.

The model writes a tool call as text; the chat template taught it how. Most open tool-calling models (Qwen2.5/3,
Hermes, and the templates derived from them) write `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
which is what this parser reads (vLLM's `hermes` parser). A block whose JSON does not parse, or names no
function, stays in the message's text: the agent sees what the model wrote.
"""

from __future__ import annotations

import json
import re
from typing import Any

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(the message's content, its tool calls) from a completion's text; content None when only calls remain."""
    calls: list[dict[str, Any]] = []

    def take(match: re.Match[str]) -> str:
        try:
            call = json.loads(match.group(1))
        except json.JSONDecodeError:
            return match.group(0)
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return match.group(0)
        arguments = call.get("arguments", {})
        calls.append(
            {
                "id": f"call_{len(calls)}",
                "type": "function",
                "function": {
                    "name": call["name"],
                    "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments),
                },
            }
        )
        return ""

    content = TOOL_CALL.sub(take, text)
    if calls:
        content = content.strip()
        return (content or None), calls
    return text, calls
