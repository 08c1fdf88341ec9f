"""Tool calls read from a completion's text (the Hermes/Qwen `<tool_call>` format)."""

from __future__ import annotations

import json

from retrain.environments.tool_calls import parse_tool_calls


def test_tool_call_blocks_become_openai_tool_calls():
    text = 'Let me add.<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content == "Let me add."
    assert calls == [{"id": "call_0", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": 2, "b": 3}


def test_only_calls_leave_no_content_and_several_calls_are_numbered():
    text = (
        '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": "{}"}</tool_call>'
    )
    content, calls = parse_tool_calls(text)
    assert content is None
    assert [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("call_0", "a", "{}"),
        ("call_1", "b", "{}"),
    ]


def test_a_malformed_block_stays_text():
    for text in ["<tool_call>{not json}</tool_call>", '<tool_call>{"arguments": {}}</tool_call>', "plain \\boxed{5}"]:
        assert parse_tool_calls(text) == (text, [])
