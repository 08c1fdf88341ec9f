"""The HTTP layer of the server engines, against a real HTTP server on loopback."""

from __future__ import annotations

import asyncio
import gc
import gzip
import logging
import socket
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler

import pytest

from retrain.errors import ConfigError
from retrain.inference.base import SamplingInterrupted
from retrain.inference.config import check_url
from retrain.inference.endpoint import EndpointServer
from retrain.inference.http import HttpClient, HttpError
from tests.inference.loopback import ok, serve
from tests.test_waiting import handled, signalled_from_another_thread


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


# ---- a whole request is bounded: in time and in size ------------------------------------------
@contextmanager
def trickling_server(bytes_per_second: float, length: int):
    """A server that answers 200 at once, then sends its body one byte at a time (each read is quick)."""

    class Trickle(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("content-length") or 0))
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(length))
            self.end_headers()
            try:
                for _ in range(length):
                    self.wfile.write(b" ")
                    self.wfile.flush()
                    time.sleep(1 / bytes_per_second)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client gave up, as it should

        def log_message(self, *args) -> None:
            pass

    server = EndpointServer(("127.0.0.1", 0), Trickle)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_timeout_s_bounds_the_whole_request_not_each_read():
    with trickling_server(bytes_per_second=20, length=200) as url:  # 10 s of body, a byte every 50 ms
        http = client(url, timeout_s=0.5)
        started = time.perf_counter()
        with pytest.raises(HttpError, match="no complete answer within 0.5 s"):
            http.post("/v1/x", {"n": 1})
        took = time.perf_counter() - started
        http.close()
    assert took < 2.0


def test_a_reply_past_the_size_cap_is_refused_unread():
    huge = {"text": "x" * (3 * 2**20)}
    with serve({"POST /v1/x": lambda body: ok(huge)}) as server:
        http = client(server.url, max_reply_bytes=2**20)
        with pytest.raises(HttpError, match=r"larger than 1 MiB \(inference.max_reply_mb\)"):
            http.post("/v1/x", {"n": 1})
        assert len(server.requests) == 1  # not retried
        http.close()


def test_a_gzip_bomb_is_capped_at_its_decompressed_size():
    bomb = gzip.compress(b"[" + b"0," * (16 * 2**20) + b"0]")  # ~32 MiB of JSON in ~32 KiB
    assert len(bomb) < 2**20
    headers = {"content-encoding": "gzip", "content-type": "application/json"}
    with serve({"POST /v1/x": lambda body: (200, bomb, headers)}) as server:
        http = client(server.url, max_reply_bytes=2**20)
        with pytest.raises(HttpError, match="larger than 1 MiB"):
            http.post("/v1/x", {"n": 1})
        http.close()


def test_a_small_gzip_reply_is_read():
    headers = {"content-encoding": "gzip", "content-type": "application/json"}
    with serve({"POST /v1/x": lambda body: (200, gzip.compress(b'{"ok": 1}'), headers)}) as server:
        http = client(server.url)
        assert http.post("/v1/x", {"n": 1}) == {"ok": 1}
        http.close()


# ---- a stop request does not wait on a stuck request -------------------------------------------
def test_interrupt_cancels_sampling_in_flight_and_close_leaves_no_pending_task(caplog):
    release = threading.Event()

    def stuck(body):
        release.wait(10)
        return ok({})

    routes = {"POST /v1/x": stuck, "POST /v1/y": lambda body: ok({"ok": body["n"]})}
    with serve(routes) as server, caplog.at_level(logging.ERROR, logger="asyncio"):
        http = client(server.url)
        threading.Timer(0.3, http.interrupt).start()
        started = time.perf_counter()
        with pytest.raises(SamplingInterrupted, match=f"requests to {server.url} cancelled by a stop request"):
            http.post_all("/v1/x", [{"n": n} for n in range(3)])
        assert time.perf_counter() - started < 3
        assert http.post("/v1/y", {"n": 1}) == {"ok": 1}  # the client still works
        http.close()
        release.set()
        gc.collect()
    assert not [record for record in caplog.records if "destroyed" in record.getMessage()]


def test_an_interrupt_that_lands_as_the_requests_go_out_cancels_them(monkeypatch):
    """The window opened on purpose (seen in CI, on a loaded machine): the requests are sent, the server holds them
    and the stop request's signal handler runs before the caller has registered the call as in flight."""
    release = threading.Event()

    def stuck(body):
        release.wait(10)
        return ok({})

    with serve({"POST /v1/x": stuck}) as server:
        http = client(server.url)
        schedule = asyncio.run_coroutine_threadsafe

        def scheduled_then_interrupted(coroutine, loop):
            future = schedule(coroutine, loop)
            http.interrupt()
            return future

        monkeypatch.setattr(asyncio, "run_coroutine_threadsafe", scheduled_then_interrupted)
        started = time.perf_counter()
        with pytest.raises(SamplingInterrupted):
            http.post_all("/v1/x", [{"n": 1}])
        assert time.perf_counter() - started < 3
        monkeypatch.undo()
        release.set()
        http.close()


def test_a_stop_signal_taken_by_another_thread_cancels_the_stuck_requests():
    """The window CI hit under load: the kernel delivered the Ctrl-C to another thread, so the main thread, blocked
    on the stuck requests, ran the stop's handler only once the server let go (the handler calls interrupt)."""
    release = threading.Event()

    def stuck(body):
        release.wait(10)
        return ok({})

    with serve({"POST /v1/x": stuck}) as server:
        http = client(server.url, timeout_s=30.0)
        with handled(http.interrupt), pytest.raises(SamplingInterrupted):
            started = time.perf_counter()
            signalled_from_another_thread()
            http.post_all("/v1/x", [{"n": n} for n in range(2)])
        assert time.perf_counter() - started < 3
        release.set()
        http.close()


def test_close_cancels_a_request_whose_caller_gave_up(caplog):
    release = threading.Event()

    def stuck(body):
        release.wait(10)
        return ok({})

    with serve({"POST /v1/x": stuck}) as server, caplog.at_level(logging.ERROR, logger="asyncio"):
        http = client(server.url)
        outcome: list[BaseException] = []

        def caller() -> None:
            try:
                http.post("/v1/x", {"n": 1})
            except BaseException as error:  # whatever it is, the test checks it below
                outcome.append(error)

        threading.Thread(target=caller, daemon=True).start()
        time.sleep(0.3)  # the request is in flight; its caller is gone (a second Ctrl-C)
        http.close()
        release.set()
        gc.collect()
    assert not [record for record in caplog.records if "destroyed" in record.getMessage()]
    assert len(outcome) == 1 and not isinstance(outcome[0], AssertionError)
