"""The HTTP layer of the server engines, against a real HTTP server on loopback."""

from __future__ import annotations

import logging
import socket
import threading
import time

import pytest

from retrain.errors import ConfigError
from retrain.inference.config import check_url
from retrain.inference.http import HttpClient, HttpError
from tests.inference.loopback import ok, serve


def client(url: str, **options) -> HttpClient:
    settings = {"timeout_s": 5.0, "max_retries": 3, "max_concurrency": 4, "backoff_s": 0.01, **options}
    return HttpClient(url, **settings)


def failing_then_ok(failures: list[tuple[int, dict[str, str]]]):
    """A route that answers each of `failures` in turn, then 200 {"ok": n}."""
    remaining = list(failures)

    def route(body):
        if remaining:
            status, headers = remaining.pop(0)
            return status, {"error": f"busy ({status})"}, headers
        return ok({"ok": body["n"]})

    return route


def test_5xx_and_429_are_retried_until_the_server_answers(caplog):
    route = failing_then_ok([(503, {}), (502, {}), (429, {})])
    with serve({"POST /v1/x": route}) as server, caplog.at_level(logging.WARNING):
        http = client(server.url)
        assert http.post("/v1/x", {"n": 7}) == {"ok": 7}
        http.close()
    assert len(server.asked("/v1/x")) == 4
    retries = [record.getMessage() for record in caplog.records if "retrying" in record.getMessage()]
    assert len(retries) == 3 and all(f"{server.url}/v1/x" in message for message in retries)


def test_retry_after_is_honoured():
    with serve({"POST /v1/x": failing_then_ok([(429, {"Retry-After": "0.4"})])}) as server:
        http = client(server.url, backoff_s=0.001)
        started = time.perf_counter()
        assert http.post("/v1/x", {"n": 1}) == {"ok": 1}
        waited = time.perf_counter() - started
        http.close()
    assert waited >= 0.4


def test_a_client_error_is_not_retried_and_names_url_status_and_body():
    with serve({"POST /v1/x": lambda body: (400, {"error": "prompt is too long for this model"}, {})}) as server:
        http = client(server.url)
        with pytest.raises(HttpError) as caught:
            http.post("/v1/x", {"n": 1})
        http.close()
    assert len(server.requests) == 1
    message = str(caught.value)
    assert f"POST {server.url}/v1/x" in message and "400" in message and "prompt is too long" in message
    assert caught.value.status == 400


def test_a_persistent_server_error_gives_up_after_max_retries():
    with serve({"POST /v1/x": lambda body: (500, "engine is dead", {})}) as server:
        http = client(server.url, max_retries=2)
        with pytest.raises(HttpError, match="500: engine is dead \\(after 3 attempts\\)"):
            http.post("/v1/x", {"n": 1})
        http.close()
    assert len(server.requests) == 3


def test_a_request_without_answer_times_out_and_is_not_resubmitted():
    def slow(body):
        time.sleep(1.0)
        return ok({})

    with serve({"POST /v1/slow": slow}) as server:
        http = client(server.url, timeout_s=0.2)
        with pytest.raises(HttpError, match="no complete answer within 0.2 s.*inference.timeout_s"):
            http.post("/v1/slow", {"n": 1})
        http.close()
    assert len(server.requests) == 1


def test_a_refused_connection_is_retried_then_named():
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    http = client(f"http://127.0.0.1:{port}", max_retries=2)
    with pytest.raises(HttpError, match=f"POST http://127.0.0.1:{port}/v1/x: ConnectError.*after 3 attempts"):
        http.post("/v1/x", {"n": 1})
    http.close()


def test_concurrency_is_bounded_and_answers_keep_their_order():
    in_flight, most, lock = [0], [0], threading.Lock()

    def tracked(body):
        with lock:
            in_flight[0] += 1
            most[0] = max(most[0], in_flight[0])
        time.sleep(0.05)
        with lock:
            in_flight[0] -= 1
        return ok({"ok": body["n"]})

    with serve({"POST /v1/x": tracked}) as server:
        http = client(server.url, max_concurrency=3)
        answers = http.post_all("/v1/x", [{"n": n} for n in range(12)])
        http.close()
    assert answers == [{"ok": n} for n in range(12)]
    assert most[0] == 3


def test_the_first_failure_of_a_batch_is_raised():
    def picky(body):
        return (400, {"error": f"bad request {body['n']}"}, {}) if body["n"] == 5 else ok({"ok": body["n"]})

    with serve({"POST /v1/x": picky}) as server:
        http = client(server.url)
        with pytest.raises(HttpError, match="bad request 5"):
            http.post_all("/v1/x", [{"n": n} for n in range(8)])
        assert http.post("/v1/x", {"n": 1}) == {"ok": 1}  # the client still works after a failed batch
        http.close()


def test_the_api_key_travels_as_a_bearer_header_and_never_in_errors():
    secret = "sk-test-0123456789"
    with serve({"POST /v1/x": lambda body: (403, {"error": "forbidden"}, {})}) as server:
        http = client(server.url, api_key=secret)
        with pytest.raises(HttpError) as caught:
            http.post("/v1/x", {"n": 1})
        http.close()
    assert server.requests[0].headers["Authorization"] == f"Bearer {secret}"
    assert secret not in str(caught.value)


def test_close_stops_the_loop_and_is_idempotent():
    with serve({"GET /health": lambda body: ok("")}) as server:
        http = client(server.url)
        assert http.get("/health") == ""
        thread = http._thread
        http.close()
        http.close()
    assert not thread.is_alive() and http._loop.is_closed()
    with pytest.raises(RuntimeError, match="closed"):
        http.get("/health")


@pytest.mark.parametrize("url", ["", "127.0.0.1:8000"])
def test_a_missing_or_bad_url_names_the_key(url):
    with pytest.raises(ConfigError, match="inference.url"):
        check_url(url)
