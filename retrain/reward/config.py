"""Schemas of the `reward` config group (conf/reward/*.yaml).

A reward option instantiates to the callable the scorer runs: `_partial_: true` for a function
(Hydra binds the configured keyword arguments), `_partial_: false` for a class whose instance is
the callable. Swapping in a plugin is `reward._target_=my_module.my_reward`.
"""

from __future__ import annotations

from dataclasses import dataclass

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


SCHEMAS: dict[str, type] = {
    "base_match": MatchRewardConfig,
    "base_math": MathRewardConfig,
    "base_judge": JudgeRewardConfig,
}
