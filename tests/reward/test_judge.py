"""`reward=judge` against a real OpenAI-compatible HTTP server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest
from hydra.utils import instantiate

from retrain.config import compose
from retrain.errors import ConfigError
from retrain.reward.judge import JudgeReward, parse_verdict
from retrain.reward.scorer import RewardScorer
from retrain.types import Example


class JudgeServer(BaseHTTPRequestHandler):
    """Grades by keyword in the student's answer; records what it was sent."""

    requests: ClassVar[list[dict]] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt = body["messages"][0]["content"]
        JudgeServer.requests.append({"path": self.path, "auth": self.headers.get("Authorization"), **body})
        answer = prompt.split("Student's answer:")[-1]
        if "BROKEN" in answer:
            self.send_error(500, "judge overloaded")
            return
        if "SLOW" in answer:
            time.sleep(0.5)
        reply = (
            "Maybe."
            if "UNSURE" in answer
            else "<think>hmm</think> **Yes**"
            if "CORRECT" in answer
            else "No, it is not."
        )
        payload = json.dumps({"choices": [{"message": {"role": "assistant", "content": reply}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), JudgeServer, bind_and_activate=False)
    server.request_queue_size = 128  # the default backlog of 5 resets some of 16 concurrent connections
    server.server_bind()
    server.server_activate()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize(
    ("reply", "verdict"),
    [
        ("yes", 1.0),
        ("Yes.", 1.0),
        ("**YES**", 1.0),
        ("no", 0.0),
        ("No, it is not.", 0.0),
        ("<think>yes?</think>\nno", 0.0),
    ],
)
def test_verdicts(reply: str, verdict: float) -> None:
    assert parse_verdict(reply) == verdict


@pytest.mark.parametrize("reply", ["", "Maybe.", "yesterday", "I think yes"])
def test_anything_but_yes_or_no_is_a_failure(reply: str) -> None:
    with pytest.raises(ValueError, match="expected yes or no"):
        parse_verdict(reply)


def test_the_judge_sees_question_reference_and_response(base_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JUDGE_TEST_KEY", "sk-test")
    judge = JudgeReward(model="judge-1", base_url=base_url, api_key_env="JUDGE_TEST_KEY")
    JudgeServer.requests.clear()
    assert asyncio.run(judge("CORRECT: 12", "12", question="What is 3*4?")) == 1.0
    assert asyncio.run(judge("13", "12", question="What is 3*4?")) == 0.0
    sent = JudgeServer.requests[0]
    assert sent["path"] == "/v1/chat/completions" and sent["model"] == "judge-1"
    assert sent["auth"] == "Bearer sk-test"
    prompt = sent["messages"][0]["content"]
    assert "What is 3*4?" in prompt and "Reference answer:\n12" in prompt and "CORRECT: 12" in prompt


def test_through_the_scorer_failures_are_counted_and_requests_overlap(base_url: str) -> None:
    cfg = compose(
        [
            "reward=judge",
            f"reward.base_url={base_url}",
            "reward.model=judge-1",
            "reward.api_key_env=RETRAIN_TEST_UNSET_KEY",
        ]
    )
    judge = instantiate(cfg.reward)
    responses = ["CORRECT SLOW"] * 12 + ["wrong SLOW"] * 2 + ["UNSURE", "BROKEN"]
    rows = [Example("q", "12", str(n), {"question": "What is 3*4?"}) for n in range(len(responses))]
    JudgeServer.requests.clear()
    with RewardScorer(judge, name=cfg.reward._target_, timeout_s=10, workers=2) as scorer:
        started = time.monotonic()
        result = scorer.score(responses, rows)
        elapsed = time.monotonic() - started
    assert result.rewards.tolist() == [1.0] * 12 + [0.0] * 4
    assert (result.errors, result.timeouts) == (2, 0)
    assert "expected yes or no" in result.failures[14] and "500" in result.failures[15]
    assert all(request["auth"] is None for request in JudgeServer.requests)  # no key when unset
    assert elapsed < 14 * 0.5 / 2  # 14 slow answers of 0.5 s overlap instead of queueing per worker


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"model": ""}, "reward.model"),
        ({"base_url": "127.0.0.1:8000"}, "reward.base_url"),
        ({"prompt_template": "no slots"}, "reward.prompt_template"),
        ({"max_concurrency": 0}, "reward.max_concurrency"),
    ],
)
def test_bad_settings_name_their_key(kwargs: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        JudgeReward(**{"model": "m", **kwargs})
