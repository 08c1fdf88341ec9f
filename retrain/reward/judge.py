"""`reward=judge`: an LLM behind an OpenAI-compatible chat-completions API answers yes or no.

The judge is async, so one scoring worker keeps many requests in flight. A reply that is neither
yes nor no, an HTTP error or a network failure raises: the completion scores 0.0 and is counted in
`reward/errors`, rather than silently reading as "wrong".
"""

from __future__ import annotations

import asyncio
import os
import re
from typing import Any

import httpx

from retrain.data.prompts import check_template, fill_template
from retrain.errors import ConfigError
from retrain.reward.config import JudgeRewardConfig

_THINKING = re.compile(r"<think>.*?</think>", re.DOTALL)
_VERDICT = re.compile(r"\W*(yes|no)\b")


def parse_verdict(reply: str) -> float:
    """1.0 for a reply that starts with "yes", 0.0 for "no" (case, markup and a think block ignored)."""
    match = _VERDICT.match(_THINKING.sub("", reply).lower())
    if match is None:
        raise ValueError(f"the judge replied {reply[:200]!r}; expected yes or no")
    return 1.0 if match.group(1) == "yes" else 0.0


class JudgeReward:
    """Asks `model` at `base_url` (e.g. http://127.0.0.1:8000/v1) whether the response is correct.
    Its defaults are those of the config schema (retrain.reward.config.JudgeRewardConfig).

    The API key is read from the environment variable named by `api_key_env` at call time, so it
    never lands in the config, the run dir or a pickle; with the variable unset, no key is sent
    (local servers such as vLLM or SGLang need none). The template's `{question}` is filled from
    the example's `extra["question"]` (every built-in data source sets it).
    """

    def __init__(
        self,
        model: str = JudgeRewardConfig.model,
        base_url: str = JudgeRewardConfig.base_url,
        api_key_env: str = JudgeRewardConfig.api_key_env,
        prompt_template: str = JudgeRewardConfig.prompt_template,
        max_tokens: int = JudgeRewardConfig.max_tokens,
        temperature: float = JudgeRewardConfig.temperature,
        request_timeout_s: float = JudgeRewardConfig.request_timeout_s,
        max_concurrency: int = JudgeRewardConfig.max_concurrency,
    ) -> None:
        if not model:
            raise ConfigError("reward.model must name the judge model, got an empty string")
        if not base_url.startswith(("http://", "https://")):
            raise ConfigError(f"reward.base_url must be an http(s) URL, got {base_url!r}")
        if max_concurrency < 1:
            raise ConfigError(f"reward.max_concurrency must be at least 1, got {max_concurrency}")
        check_template(prompt_template, {"response"}, "reward.prompt_template")
        self.model = model
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.api_key_env = api_key_env
        self.prompt_template = prompt_template
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.request_timeout_s = request_timeout_s
        self.max_concurrency = max_concurrency
        self._client: httpx.AsyncClient | None = None
        self._client_loop: asyncio.AbstractEventLoop | None = None

    async def __call__(self, response: str, reference: str, **extra: Any) -> float:
        prompt = fill_template(
            self.prompt_template, question=str(extra.get("question", "")), reference=reference, response=response
        )
        payload = {
            "model": self.model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
        }
        reply = await self._client_for_this_loop().post(self.url, json=payload, headers=self._headers())
        reply.raise_for_status()
        try:
            content = reply.json()["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise ValueError(f"the judge's reply is not a chat completion: {reply.text[:200]!r}") from exc
        return parse_verdict(content or "")

    def _headers(self) -> dict[str, str]:
        key = os.environ.get(self.api_key_env, "") if self.api_key_env else ""
        return {"Authorization": f"Bearer {key}"} if key else {}

    def _client_for_this_loop(self) -> httpx.AsyncClient:
        """One pooled client per event loop (a client cannot move between loops).

        The connection limit queues requests beyond `max_concurrency`; the queue wait is not timed
        here (pool=None) because the scorer's per-completion timeout already bounds it.
        """
        loop = asyncio.get_running_loop()
        if self._client is None or self._client_loop is not loop:
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(self.request_timeout_s, pool=None),
                limits=httpx.Limits(max_connections=self.max_concurrency),
            )
            self._client_loop = loop
        return self._client

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_client": None, "_client_loop": None}
