"""`reward=judge`: an LLM behind an OpenAI-compatible chat-completions API answers yes or no.

The judge is async, so one scoring worker keeps many requests in flight. A busy or failing server
(HTTP 429 or 5xx, a dropped connection, a request timeout) is asked again after a growing pause
(`Retry-After` when it sends one), while `max_wait_s` allows. A completion the judge could not score
(retries spent, another HTTP error, a reply that is no chat completion, larger than `max_reply_bytes`,
or neither yes nor no) raises NoVerdict: it is left out of training and counted in `reward/excluded`,
rather than scored 0.0, which would train the policy away from answers nobody judged.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
from typing import Any

import httpx

from retrain.data.prompts import fill_template
from retrain.housekeeping.digits import whole_number
from retrain.plugins import built_in
from retrain.reward.checks import NoVerdict
from retrain.reward.config import JudgeRewardConfig
from retrain.settings_object import takes_settings

_THINKING = re.compile(r"<think>.*?</think>", re.DOTALL)
_VERDICT = re.compile(r"\W*(yes|no)\b")
_JITTER = random.Random()  # spreads the retries of many rows; its own generator leaves the caller's untouched


def parse_verdict(reply: str) -> float:
    """1.0 for a reply that starts with "yes", 0.0 for "no" (case, markup and a think block ignored)."""
    match = _VERDICT.match(_THINKING.sub("", reply).lower())
    if match is None:
        raise ValueError(f"the judge replied {reply[:200]!r}; expected yes or no")
    return 1.0 if match.group(1) == "yes" else 0.0


@built_in
@takes_settings(JudgeRewardConfig)
class JudgeReward:
    """Asks `config.model` at `config.base_url` (e.g. http://127.0.0.1:8000/v1) whether the response is correct.

    The API key is read from the environment variable named by `api_key_env` at call time, so it
    never lands in the config, the run dir or a pickle; with the variable unset, no key is sent
    (local servers such as vLLM or SGLang need none). The template's `{question}` is filled from
    the example's `extra["question"]` (every built-in data source sets it).
    """

    def __init__(self, config: JudgeRewardConfig) -> None:
        self.config = config
        self.url = config.base_url.rstrip("/") + "/chat/completions"
        self._client: httpx.AsyncClient | None = None
        self._client_loop: asyncio.AbstractEventLoop | None = None

    async def __call__(self, response: str, reference: str, **extra: Any) -> float:
        prompt = fill_template(
            self.config.prompt_template, question=str(extra.get("question", "")), reference=reference, response=response
        )
        payload = {
            "model": self.config.model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": self.config.max_tokens,
            "temperature": self.config.temperature,
        }
        body = await self._ask(payload)
        try:
            content = json.loads(body)["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise NoVerdict(f"the judge's reply is not a chat completion: {body[:200]!r}") from exc
        try:
            return parse_verdict(content or "")
        except ValueError as exc:
            raise NoVerdict(str(exc)) from exc

    async def _ask(self, payload: dict[str, Any]) -> bytes:
        """The body of the judge's HTTP 200 reply; retries busy or failing servers while `max_wait_s` allows."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.max_wait_s
        for attempt in range(self.config.max_retries + 1):
            retry_after: float | None = None
            try:
                async with asyncio.timeout_at(deadline):
                    status, body, retry_after = await self._post(payload)
            except TimeoutError:
                raise NoVerdict(
                    f"the judge did not answer within reward.max_wait_s={self.config.max_wait_s:g} s"
                ) from None
            except httpx.TransportError as exc:  # refused or dropped connection, request timeout, ...
                failure = f"{type(exc).__name__}: {exc}"
            else:
                if status == 200:
                    return body
                failure = f"HTTP {status} {body[:200]!r}"
                if status != 429 and status < 500:  # the request itself is wrong: asking again cannot help
                    raise NoVerdict(f"the judge answered {failure}")
            if attempt == self.config.max_retries:
                break
            pause = self.config.retry_backoff_s * 2**attempt * (1.0 + 0.5 * _JITTER.random())
            pause = pause if retry_after is None else retry_after
            if loop.time() + pause >= deadline:
                raise NoVerdict(
                    f"the judge failed ({failure}) and reward.max_wait_s={self.config.max_wait_s:g} s leaves no time to retry"
                )
            await asyncio.sleep(pause)
        raise NoVerdict(f"the judge failed {self.config.max_retries + 1} times; the last: {failure}")

    async def _post(self, payload: dict[str, Any]) -> tuple[int, bytes, float | None]:
        """(status, body, Retry-After seconds); NoVerdict for a body past `max_reply_bytes`, never read whole."""
        client = self._client_for_this_loop()
        async with client.stream("POST", self.url, json=payload, headers=self._headers()) as reply:
            declared = reply.headers.get("content-length", "")
            if (whole_number(declared) or 0) > self.config.max_reply_bytes:
                raise NoVerdict(self._too_large(f"announces {declared} bytes"))
            body = bytearray()
            async for piece in reply.aiter_bytes():
                body += piece
                if len(body) > self.config.max_reply_bytes:
                    raise NoVerdict(self._too_large(f"ran past {len(body)} bytes"))
            return reply.status_code, bytes(body), _seconds(reply.headers.get("retry-after"))

    def _too_large(self, what: str) -> str:
        return f"the judge's reply {what}, more than reward.max_reply_bytes={self.config.max_reply_bytes}"

    def _headers(self) -> dict[str, str]:
        key = os.environ.get(self.config.api_key_env, "") if self.config.api_key_env else ""
        return {"Authorization": f"Bearer {key}"} if key else {}

    def _client_for_this_loop(self) -> httpx.AsyncClient:
        """One pooled client per event loop (a client cannot move between loops).

        The connection limit queues requests beyond `max_concurrency`; the queue wait is not timed
        here (pool=None) because the scorer's per-completion timeout already bounds it.
        """
        loop = asyncio.get_running_loop()
        if self._client is None or self._client_loop is not loop:
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(self.config.request_timeout_s, pool=None),
                limits=httpx.Limits(max_connections=self.config.max_concurrency),
            )
            self._client_loop = loop
        return self._client

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_client": None, "_client_loop": None}


def _seconds(retry_after: str | None) -> float | None:
    """A `Retry-After` header given in seconds; None when absent or an HTTP date (the backoff applies)."""
    try:
        return max(0.0, float(retry_after)) if retry_after is not None else None
    except ValueError:
        return None
