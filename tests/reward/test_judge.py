"""`reward=judge` against a real OpenAI-compatible HTTP server on 127.0.0.1 (well-behaved, busy, failing, hostile)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from typing import ClassVar

import pytest

from retrain.config import compose
from retrain.errors import ConfigError
from retrain.inference.endpoint import EndpointServer
from retrain.reward.checks import NoVerdict
from retrain.reward.config import JudgeRewardConfig
from retrain.reward.judge import JudgeReward, parse_verdict
from retrain.reward.scorer import RewardScorer
from retrain.run import build_part
from retrain.types import Example


class JudgeServer(BaseHTTPRequestHandler):
    """Grades by keyword in the student's answer; records what it was sent and how often each answer came."""

    requests: ClassVar[list[dict]] = []
    attempts: ClassVar[dict[str, int]] = {}
    release = threading.Event()  # a HANGING answer is held until the test sets this

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt = body["messages"][0]["content"]
        JudgeServer.requests.append({"path": self.path, "auth": self.headers.get("Authorization"), **body})
        answer = prompt.split("Student's answer:")[-1]
        seen = JudgeServer.attempts[answer] = JudgeServer.attempts.get(answer, 0) + 1
        if "BROKEN" in answer:
            self.send_error(500, "judge overloaded")
            return
        if "REFUSED" in answer:
            self.send_error(400, "bad request")
            return
        if "BUSY" in answer and seen <= 2:  # rate-limited twice, then served
            self.send_response(429)
            self.send_header("Retry-After", "0")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if "DOWN" in answer and seen <= 2:
            self.send_error(503, "try later")
            return
        if "ANNOUNCED" in answer:  # says 1 GB, sends a little
            self.send_response(200)
            self.send_header("Content-Length", str(10**9))
            self.end_headers()
            self.wfile.write(b"{}")
            return
        if "ENDLESS" in answer:  # no length: 32 MB of one JSON string, unless the client hangs up first
            self.send_response(200)
            self.end_headers()
            try:
                self.wfile.write(b'{"choices": "')
                for _ in range(512):
                    self.wfile.write(b"x" * 65536)
            except (BrokenPipeError, ConnectionResetError):
                pass
            return
        if "HANGING" in answer and ("RETRIED" not in answer or seen > 1):  # RETRIED: fails once, then hangs
            JudgeServer.release.wait(timeout=60)
            return
        if "RETRIED" in answer:
            self.send_error(503, "try later")
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
    server = EndpointServer(("127.0.0.1", 0), JudgeServer)
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
    judge = JudgeReward(JudgeRewardConfig(model="judge-1", base_url=base_url, api_key_env="JUDGE_TEST_KEY"))
    JudgeServer.requests.clear()
    assert asyncio.run(judge("CORRECT: 12", "12", question="What is 3*4?")) == 1.0
    assert asyncio.run(judge("13", "12", question="What is 3*4?")) == 0.0
    sent = JudgeServer.requests[0]
    assert sent["path"] == "/v1/chat/completions" and sent["model"] == "judge-1"
    assert sent["auth"] == "Bearer sk-test"
    prompt = sent["messages"][0]["content"]
    assert "What is 3*4?" in prompt and "Reference answer:\n12" in prompt and "CORRECT: 12" in prompt


def test_through_the_scorer_unjudged_rows_are_excluded_and_requests_overlap(base_url: str) -> None:
    cfg = compose(
        [
            "reward=judge",
            f"reward.base_url={base_url}",
            "reward.model=judge-1",
            "reward.api_key_env=RETRAIN_TEST_UNSET_KEY",
            "reward.retry_backoff_s=0.01",
        ]
    )
    judge = build_part(cfg, "reward")
    responses = ["CORRECT SLOW"] * 12 + ["wrong SLOW"] * 2 + ["UNSURE", "BROKEN"]
    rows = [Example("q", "12", str(n), {"question": "What is 3*4?"}) for n in range(len(responses))]
    JudgeServer.requests.clear()
    with RewardScorer(judge, name=cfg.reward._target_, timeout_s=10, workers=2) as scorer:
        started = time.monotonic()
        result = scorer.score(responses, rows)
        elapsed = time.monotonic() - started
    assert result.rewards.tolist()[:14] == [1.0] * 12 + [0.0] * 2
    # no verdict is not a verdict of "wrong": those rows are excluded, not scored 0 and counted as errors
    assert (result.errors, result.timeouts, sorted(result.excluded)) == (0, 0, [14, 15])
    assert result.excluded_mask().tolist() == [False] * 14 + [True] * 2
    assert "expected yes or no" in result.excluded[14]
    assert "failed 4 times" in result.excluded[15] and "HTTP 500" in result.excluded[15]
    assert all(request["auth"] is None for request in JudgeServer.requests)  # no key when unset
    assert elapsed < 14 * 0.5 / 2  # 14 slow answers of 0.5 s overlap instead of queueing per worker


def judged(judge: JudgeReward, answer: str) -> float:
    return asyncio.run(judge(answer, "12", question="What is 3*4?"))


@pytest.mark.parametrize("answer", ["CORRECT BUSY", "CORRECT DOWN"])
def test_a_busy_or_failing_judge_is_asked_again_until_it_answers(base_url: str, answer: str) -> None:
    JudgeServer.attempts.clear()
    judge = JudgeReward(JudgeRewardConfig(model="m", base_url=base_url, retry_backoff_s=0.01))
    assert judged(judge, answer) == 1.0
    assert list(JudgeServer.attempts.values()) == [3]  # two failures (429 with Retry-After: 0, or 503), one answer


@pytest.mark.parametrize(
    ("answer", "attempts", "why"),
    [
        ("BROKEN", 3, "the judge failed 3 times; the last: HTTP 500"),
        ("REFUSED", 1, "the judge answered HTTP 400"),  # a wrong request is not asked again
        ("UNSURE", 1, "the judge replied 'Maybe.'; expected yes or no"),
    ],
)
def test_a_judge_that_cannot_score_gives_no_verdict(base_url: str, answer: str, attempts: int, why: str) -> None:
    JudgeServer.attempts.clear()
    judge = JudgeReward(JudgeRewardConfig(model="m", base_url=base_url, max_retries=2, retry_backoff_s=0.01))
    with pytest.raises(NoVerdict, match=why):
        judged(judge, answer)
    assert list(JudgeServer.attempts.values()) == [attempts]


@pytest.mark.parametrize(("answer", "why"), [("ANNOUNCED", "announces 1000000000 bytes"), ("ENDLESS", "ran past")])
def test_a_huge_reply_is_never_read_whole(base_url: str, answer: str, why: str) -> None:
    judge = JudgeReward(JudgeRewardConfig(model="m", base_url=base_url, max_reply_bytes=100_000, retry_backoff_s=0.01))
    started = time.monotonic()
    with pytest.raises(NoVerdict, match=f"{why}.*reward.max_reply_bytes=100000"):
        judged(judge, answer)
    assert time.monotonic() - started < 5.0


def test_an_unreachable_judge_is_retried_then_gives_no_verdict() -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    judge = JudgeReward(
        JudgeRewardConfig(model="m", base_url=f"http://127.0.0.1:{port}/v1", max_retries=1, retry_backoff_s=0.01)
    )
    with pytest.raises(NoVerdict, match="failed 2 times; the last: ConnectError"):
        judged(judge, "12")


@pytest.mark.parametrize(("answer", "attempts"), [("HANGING", 1), ("RETRIED HANGING", 2)])
def test_max_wait_bounds_a_judge_call_retries_included(base_url: str, answer: str, attempts: int) -> None:
    """The server holds the (last) request until released, so only max_wait_s can end the call: no clock margin."""
    JudgeServer.attempts.clear()
    JudgeServer.release.clear()
    judge = JudgeReward(JudgeRewardConfig(model="m", base_url=base_url, max_wait_s=0.2, retry_backoff_s=0.01))
    started = time.monotonic()
    try:
        with pytest.raises(NoVerdict, match=r"did not answer within reward.max_wait_s=0.2 s"):
            judged(judge, answer)
        assert time.monotonic() - started >= 0.2  # the wait is the whole budget, the failed attempt included
        assert list(JudgeServer.attempts.values()) == [attempts]
    finally:
        JudgeServer.release.set()


def test_a_retry_is_not_started_when_its_pause_would_outlast_max_wait(base_url: str) -> None:
    JudgeServer.attempts.clear()
    judge = JudgeReward(JudgeRewardConfig(model="m", base_url=base_url, retry_backoff_s=60.0, max_wait_s=30.0))
    started = time.monotonic()
    with pytest.raises(NoVerdict, match="HTTP 500.*leaves no time to retry"):
        judged(judge, "BROKEN")
    assert list(JudgeServer.attempts.values()) == [1]
    assert time.monotonic() - started < 30.0  # gave up at once rather than sleeping to the deadline


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"model": ""}, "reward.model"),
        ({"base_url": "127.0.0.1:8000"}, "reward.base_url"),
        ({"prompt_template": "no slots"}, "reward.prompt_template"),
        ({"max_concurrency": 0}, "reward.max_concurrency"),
        ({"max_reply_bytes": 0}, "reward.max_reply_bytes"),
        ({"max_retries": -1}, "reward.max_retries"),
        ({"retry_backoff_s": float("nan")}, "reward.retry_backoff_s"),
        ({"max_wait_s": 0}, "reward.max_wait_s"),
    ],
)
def test_bad_settings_name_their_key(kwargs: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        JudgeReward(JudgeRewardConfig(**{"model": "m", **kwargs}))
