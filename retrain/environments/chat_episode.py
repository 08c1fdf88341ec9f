"""One agent episode's calls to `/v1/chat/completions`, kept as one token row: token in, token out.

The agent sends messages; the row must hold the exact tokens the model saw and sampled, or the trainer would
recompute log-probs of tokens the sampler never produced (re-tokenization drift). So the chat template is applied
once, here, and never to the model's own turns again:

- the first call's prompt is the template over its messages (and tools), with the generation prompt;
- a later call must extend the conversation: its messages start with the previous call's messages and the reply
  we sent (role and text; tool-call ids and other fields are not compared). Its prompt is then the row so far
  (the previous prompt and the sampled tokens, exactly) and what the template writes after the reply: the rest of
  the reply's turn (less the stop token the model sampled), the new messages and the generation prompt;
- a call that does not extend it (the agent edited, dropped or re-ordered earlier turns, changed the tools, or
  sent calls of one episode in parallel) branches the episode, which retrain refuses: that call is answered 400 saying so and the
  episode is excluded from training (one row per episode; see docs/agents.md).

The model's tokens are marked sampled (trained), with the sampler's log-probs; the rest (messages, tool results,
template tokens) stay in the row as context with log-prob 0, as in a verifiers episode (retrain.environments.base).
Every call samples with the run's temperature and top_p and a seed of (episode seed, call index); the request's own
temperature, top_p and seed are ignored, and its max_tokens may only lower the run's (and the context's room).
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from retrain.environments.base import Trajectory
from retrain.environments.tool_calls import parse_tool_calls
from retrain.inference.completions import Completion, request_seed
from retrain.inference.endpoint import SERVED_MODEL, RequestError
from retrain.inference.requests import TokenRequest
from retrain.types import SamplingParams

ROLES = ("system", "developer", "user", "assistant", "tool")
MARK = "\x00retrain:reply\x00"  # stands for a reply's text, to find what the template writes after it


class ChatEpisode:
    """Answers one episode's chat completions requests and records them as a row; see the module docstring."""

    def __init__(
        self,
        tokenizer: Any,
        sampling: SamplingParams,
        seed: int | None,
        complete: Callable[[TokenRequest], Completion],
        max_model_len: int | None,
    ) -> None:
        self.tokenizer = tokenizer
        self.sampling = sampling
        self.seed = seed
        self.complete = complete
        self.max_model_len = max_model_len
        self.calls = 0
        self.refused: str | None = None  # why the episode cannot be trained (it branched), once it did
        self.answer = ""  # the text of the last reply (data.reward_from=reward scores it)
        self.tokens: list[int] = []
        self.sampled: list[bool] = []
        self.logprobs: list[float] = []
        self._prompt_length = 0
        self._conversation: list[dict[str, Any]] = []  # the last call's messages and our reply
        self._tools: list[Any] | None = None  # the first call's: the row's prompt renders them
        self._last: Completion | None = None
        self._lock = threading.Lock()  # one call at a time: a row grows in call order

    def __call__(self, body: dict[str, Any]) -> dict[str, Any]:
        messages, tools, max_tokens = _request(body)
        with self._lock:
            if self.refused is not None:
                raise RequestError(self.refused)
            prompt = self._prompt(messages, tools)
            room = None if self.max_model_len is None else self.max_model_len - len(prompt)
            if room is not None and room < 1:
                raise RequestError(
                    f"the conversation takes {len(prompt)} tokens, the model's whole context ({self.max_model_len})"
                )
            limit = min(n for n in (self.sampling.max_tokens, max_tokens, room) if n is not None)
            seed = None if self.seed is None else request_seed(self.seed, self.calls)
            completion = self.complete(TokenRequest(prompt, replace(self.sampling, max_tokens=limit), seed))
            self._record(prompt, completion)
            text = self.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
            content, calls = parse_tool_calls(text) if tools else (text, [])
            reply: dict[str, Any] = {"role": "assistant", "content": content}
            if calls:
                reply["tool_calls"] = calls
            self._conversation = [*messages, reply]
            self.answer = content or ""
            self.calls += 1
        finish = "tool_calls" if calls else "length" if completion.hit_max_tokens else "stop"
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": SERVED_MODEL,
            "choices": [{"index": 0, "message": reply, "finish_reason": finish, "logprobs": None}],
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": len(completion.token_ids),
                "total_tokens": len(prompt) + len(completion.token_ids),
            },
        }

    def trajectory(self, reward: float | None) -> Trajectory:
        """The episode as a row with `reward`; no verdict (None) when it branched or never called the model."""
        with self._lock:
            if self.refused is not None or not self.calls:
                return Trajectory([], [], [], [], reward=None)
            start = self._prompt_length
            return Trajectory(
                prompt_ids=self.tokens[:start],
                completion_ids=self.tokens[start:],
                sampled=self.sampled[start:],
                logprobs=self.logprobs[start:],
                reward=reward,
                hit_max_tokens=self._last is not None and self._last.hit_max_tokens,
            )

    def _prompt(self, messages: list[dict[str, Any]], tools: list[Any] | None) -> list[int]:
        """This call's prompt ids: the template over the first call's messages, else the row so far and the new turns."""
        if not self.calls:
            self._tools = tools
            return self._encode(self._render(messages, tools, generation=True))
        if tools != self._tools:
            self._refuse(
                f"call {self.calls + 1} of this episode offers other tools than call 1, whose prompt (in the row) "
                "renders them: the episode branches, and retrain trains one row per episode, so it is excluded"
            )
        known = len(self._conversation)
        if len(messages) <= known or [_turn(m) for m in messages[:known]] != [_turn(m) for m in self._conversation]:
            self._refuse(
                f"call {self.calls + 1} of this episode does not extend the conversation of call {self.calls} and its "
                "reply (earlier turns were edited, dropped or re-ordered, or calls were sent in parallel): the "
                "episode branches, and retrain trains one row per episode, so it is excluded"
            )
        return [*self.tokens, *self._encode(self._after_reply(messages, known, tools))]

    def _after_reply(self, messages: list[dict[str, Any]], known: int, tools: list[Any] | None) -> str:
        """The text that follows the last reply (message `known` - 1) in the template's rendering of `messages` with
        the generation prompt: the end of the reply's turn, the new messages and the prompt for the next reply, less
        the stop token the model sampled. The reply is rendered as a mark, so what the template writes for it and
        for the turns before it (which some templates rewrite once later turns follow, e.g. Qwen3 drops earlier
        reasoning) never matters: the row keeps the tokens the model saw and sampled."""
        marked = [*messages[: known - 1], {"role": "assistant", "content": MARK}, *messages[known:]]
        rendered = self._render(marked, tools, generation=True)
        if MARK not in rendered:
            self._refuse("the chat template does not render an assistant message's content, so no turn can follow it")
        after = rendered[rendered.index(MARK) + len(MARK) :]
        assert self._last is not None
        if self._last.token_ids and not self._last.hit_max_tokens:
            stop = self.tokenizer.decode(self._last.token_ids[-1:])
            if after.startswith(stop):
                after = after[len(stop) :]
        return after

    def _record(self, prompt: list[int], completion: Completion) -> None:
        new = prompt[len(self.tokens) :]
        if not self.calls:
            self._prompt_length = len(prompt)
        self.tokens += [*new, *completion.token_ids]
        self.sampled += [False] * len(new) + [True] * len(completion.token_ids)
        self.logprobs += [0.0] * len(new) + completion.logprobs
        self._last = completion

    def _refuse(self, reason: str) -> None:
        self.refused = reason
        raise RequestError(reason)

    def _render(self, messages: list[dict[str, Any]], tools: list[Any] | None, generation: bool) -> str:
        return str(
            self.tokenizer.apply_chat_template(
                [_renderable(m) for m in messages], tools=tools, add_generation_prompt=generation, tokenize=False
            )
        )

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))


def _request(body: dict[str, Any]) -> tuple[list[dict[str, Any]], list[Any] | None, int | None]:
    """(messages, tools, max_tokens) of a chat completions request, or RequestError naming what is wrong."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list of chat messages")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise RequestError(f"messages[{index}] must be an object with a role among {', '.join(ROLES)}")
    tools = body.get("tools")
    if tools is not None and not (
        isinstance(tools, list) and all(isinstance(t, dict) and isinstance(t.get("function"), dict) for t in tools)
    ):
        raise RequestError('tools must be a list of {"type": "function", "function": {...}} objects')
    if body.get("n", 1) != 1:
        raise RequestError("n must be 1: send one request per completion")
    if body.get("stream"):
        raise RequestError("stream=true is not supported by retrain's training endpoint")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise RequestError(f"max_tokens must be a positive integer, got {max_tokens!r}")
    return messages, (tools or None), max_tokens


def _text(content: Any) -> str:
    """A message's text: a string, or the text parts of a list of content parts."""
    if content is None:
        return ""
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return str(content)


def _turn(message: dict[str, Any]) -> tuple[str, str]:
    """What must match for a later call to extend a conversation: the role and the text."""
    return str(message.get("role")), _text(message.get("content")).strip()


def _renderable(message: dict[str, Any]) -> dict[str, Any]:
    """A message as chat templates take it: text content, tool-call arguments as objects (they arrive as JSON)."""
    out = {key: value for key, value in message.items() if value is not None}
    out["content"] = _text(message.get("content"))
    calls = message.get("tool_calls")
    if calls:
        out["tool_calls"] = [_call_with_object_arguments(call) for call in calls]
    return out


def _call_with_object_arguments(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except json.JSONDecodeError:
        return call
    return {**call, "function": {**function, "arguments": arguments}}
