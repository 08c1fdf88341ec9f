"""A server's replies are checked like a plugin's outputs, before anything is trained on them.

The one validation layer of the engines that sample on a server (vllm_server, sglang, openai): they
read every field through a `ServerRoute`, so a missing, null or mistyped field ends the run with one
line naming the engine, the url and the field, never a traceback; and every completion passes the
same value checks before it becomes Rollouts: integer token ids inside the model's vocabulary, no
more tokens than max_tokens, and one finite log-prob <= 0 per token. A NaN, infinite or positive
log-prob is the server's fault, and the error says so, instead of surfacing steps later as skipped
optimizer steps or a diverged adapter.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NoReturn

from retrain.errors import UserError
from retrain.inference.completions import Completion

LOGPROB_SLACK = 1e-4  # a server's log_softmax rounds a near-certain token's log-prob to at most this above 0
FLOAT32_MAX = 3.4028234663852886e38  # a log-prob below -this is -inf once the trainer holds it in float32
EXCERPT_CHARS = 80


class ServerReplyError(UserError):
    """A server answered something the trainer cannot use: malformed, or impossible values."""


def shown(value: Any) -> str:
    """A value as an error shows it: its JSON type and the start of it."""
    kind = {str: "text", dict: "object", list: "array", bool: "boolean", type(None): "null"}.get(type(value))
    kind = kind or ("number" if isinstance(value, int | float) else type(value).__name__)
    text = " ".join(repr(value).split())
    return f"{kind} {text[:EXCERPT_CHARS] + '…' if len(text) > EXCERPT_CHARS else text}"


@dataclass(frozen=True)
class ReplyLimits:
    """What a completion's values must stay within."""

    max_tokens: int  # the request's max_tokens
    vocab_size: int  # token ids run from 0 to vocab_size - 1


def vocab_size(tokenizer: Any, model: Any | None) -> int:
    """The ids a served model can sample: its embedding rows (model.config.vocab_size, often padded past
    the tokenizer), or the tokenizer's ids when the engine holds no model."""
    configured = getattr(getattr(model, "config", None), "vocab_size", None)
    return max(len(tokenizer), int(configured) if isinstance(configured, int) else 0)


@dataclass(frozen=True)
class ServerRoute:
    """Reads one route's replies for one engine: every failure names `engine`, `url` and the field."""

    engine: str  # the inference config group, e.g. "vllm_server"
    url: str  # the route's full url

    def fail(self, field: str, problem: str) -> NoReturn:
        raise ServerReplyError(f"inference={self.engine}: {self.url} answered {problem} at `{field or '(the reply)'}`")

    @contextmanager
    def reading(self, what: str) -> Iterator[None]:
        """Any shape the explicit checks did not foresee still fails in one line naming the route."""
        try:
            yield
        except (KeyError, IndexError, TypeError, AttributeError, ValueError) as error:
            if isinstance(error, UserError):
                raise
            problem = f"missing field {error}" if isinstance(error, KeyError) else f"{type(error).__name__}: {error}"
            raise ServerReplyError(
                f"inference={self.engine}: {self.url} answered an unusable {what} ({problem})"
            ) from None

    def mapping(self, value: Any, field: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            self.fail(field, f"{shown(value)} where a JSON object belongs")
        return value

    def array(self, value: Any, field: str) -> list[Any]:
        if not isinstance(value, list):
            self.fail(field, f"{shown(value)} where an array belongs")
        return value

    def member(self, value: Any, key: str, field: str) -> Any:
        """`value[key]`, which must be present and not null (`field` names `value`)."""
        found = self.mapping(value, field).get(key)
        if found is None:
            self.fail(f"{field}.{key}" if field else key, "no value" if key not in value else "null")
        return found

    def text(self, value: Any, field: str) -> str:
        if not isinstance(value, str):
            self.fail(field, f"{shown(value)} where a string belongs")
        return value

    def integer(self, value: Any, field: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(field, f"{shown(value)} where an integer belongs")
        return value

    def token_ids(self, value: Any, field: str) -> list[int]:
        return [self.integer(token, f"{field}[{i}]") for i, token in enumerate(self.array(value, field))]

    def logprobs(self, value: Any, field: str) -> list[float]:
        """Numbers only (null or text is malformed); their values are checked by `completion`."""
        numbers = []
        for i, number in enumerate(self.array(value, field)):
            if isinstance(number, bool) or not isinstance(number, int | float):
                self.fail(f"{field}[{i}]", f"{shown(number)} where a log-prob (a number) belongs")
            numbers.append(float(number))
        return numbers

    def completion(
        self, token_ids: list[int], logprobs: list[float], hit_max_tokens: bool, limits: ReplyLimits, field: str
    ) -> Completion:
        """A completion whose values are possible: the checks every server engine shares."""
        if len(token_ids) > limits.max_tokens:
            self.fail(field, f"{len(token_ids)} tokens where max_tokens is {limits.max_tokens}")
        if len(logprobs) != len(token_ids):
            self.fail(field, f"{len(logprobs)} log-probs for {len(token_ids)} tokens (one per token is needed)")
        for i, token in enumerate(token_ids):
            if not 0 <= token < limits.vocab_size:
                self.fail(f"{field} token {i}", f"token id {token}, outside the vocabulary [0, {limits.vocab_size})")
        for i, value in enumerate(logprobs):
            if math.isnan(value):
                self.fail(f"{field} token {i}", "a NaN log-prob (the server's numerics failed, not the trainer's)")
            if not -FLOAT32_MAX <= value:
                self.fail(f"{field} token {i}", f"log-prob {value:g} for a token it sampled (probability 0)")
            if value > LOGPROB_SLACK:
                self.fail(f"{field} token {i}", f"log-prob {value:g} > 0 (a probability above 1)")
        return Completion(token_ids, logprobs, hit_max_tokens)
