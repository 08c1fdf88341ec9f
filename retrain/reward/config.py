"""Schemas of the `reward` config group (conf/reward/*.yaml).

A reward option instantiates to the callable the scorer runs: `_partial_: true` for a function
(Hydra binds the configured keyword arguments), `_partial_: false` for a class whose instance is
the callable. Swapping in a plugin is `reward._target_=my_module.my_reward`.
"""

from __future__ import annotations

from dataclasses import dataclass

from retrain.data.prompts import check_template
from retrain.errors import ConfigError

DEFAULT_JUDGE_TEMPLATE = """You are grading a student's answer to a problem.

Problem:
{question}

Reference answer:
{reference}

Student's answer:
{response}

Does the student's final answer agree with the reference answer? Reply with one word: yes or no."""


@dataclass
class MatchRewardConfig:
    """Exact match of the last boxed answer (also the schema for plain function plugins)."""

    _target_: str = "retrain.reward.match.match_reward"
    _partial_: bool = True


@dataclass
class MathRewardConfig:
    """math-verify equivalence; whole-second bounds on each parse and each comparison."""

    _target_: str = "retrain.reward.math.MathReward"
    _partial_: bool = False
    parse_timeout_s: int = 5
    verify_timeout_s: int = 5
    cache_size: int = 4096  # parsed references kept per scoring worker

    def __post_init__(self) -> None:
        for key in ("parse_timeout_s", "verify_timeout_s", "cache_size"):
            if getattr(self, key) < 1:
                raise ConfigError(f"reward.{key} must be at least 1, got {getattr(self, key)}")


@dataclass
class JudgeRewardConfig:
    """An LLM judge behind an OpenAI-compatible chat-completions endpoint."""

    _target_: str = "retrain.reward.judge.JudgeReward"
    _partial_: bool = False
    model: str = "gpt-4o-mini"
    base_url: str = "https://api.openai.com/v1"
    api_key_env: str = "OPENAI_API_KEY"  # name of the variable holding the key, never the key
    prompt_template: str = DEFAULT_JUDGE_TEMPLATE  # slots: {question} {reference} {response}
    max_tokens: int = 16
    temperature: float = 0.0
    request_timeout_s: float = 20.0  # per HTTP request; scoring.timeout_s bounds the whole call
    max_concurrency: int = 32  # requests in flight per scoring worker
    max_reply_bytes: int = 1_000_000  # a longer reply is not read on: no verdict (the completion is excluded)
    max_retries: int = 3  # asks again after HTTP 429/5xx, a dropped connection or a request timeout
    retry_backoff_s: float = 1.0  # first pause before asking again, doubled each time (Retry-After wins)
    max_wait_s: float = 25.0  # then the completion gets no verdict; keep it below scoring.timeout_s

    def __post_init__(self) -> None:
        if not self.model:
            raise ConfigError("reward.model must name the judge model, got an empty string")
        if not self.base_url.startswith(("http://", "https://")):
            raise ConfigError(f"reward.base_url must be an http(s) URL, got {self.base_url!r}")
        if self.max_concurrency < 1:
            raise ConfigError(f"reward.max_concurrency must be at least 1, got {self.max_concurrency}")
        if self.max_reply_bytes < 1:
            raise ConfigError(f"reward.max_reply_bytes must be at least 1, got {self.max_reply_bytes}")
        if self.max_retries < 0:
            raise ConfigError(f"reward.max_retries must be 0 or more, got {self.max_retries}")
        if not self.retry_backoff_s >= 0:
            raise ConfigError(f"reward.retry_backoff_s must be 0 or more, got {self.retry_backoff_s}")
        if not self.max_wait_s > 0:
            raise ConfigError(f"reward.max_wait_s must be positive, got {self.max_wait_s}")
        check_template(self.prompt_template, {"response"}, "reward.prompt_template")


SCHEMAS: dict[str, type] = {
    "base_match": MatchRewardConfig,
    "base_math": MathRewardConfig,
    "base_judge": JudgeRewardConfig,
}
