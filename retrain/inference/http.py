"""The one HTTP layer of the engines that sample on a server (vLLM, SGLang, OpenAI-compatible).

The trainer is synchronous, a step's requests are many: they run concurrently (at most
`max_concurrency` at once) on one private event loop in a daemon thread, behind blocking calls,
so callers need no loop of their own (and may even sit inside one) and no loop outlives `close()`.
Transient failures (429, 5xx, refused or dropped connections) are retried with exponential backoff
and jitter, honouring Retry-After. `timeout_s` bounds each attempt whole, from sending to the
last byte of the reply (a server trickling bytes cannot stretch it); an attempt that gets no complete
answer in time is not resubmitted (the server may still be working on it). A reply is read streamed
and refused past `max_reply_bytes` of decoded body, so a huge or decompression-bomb answer never
fills memory. Sampling requests (`post_all`) can be cancelled by `interrupt()` (a stop request), and
`close()` cancels whatever is still in flight before it stops the loop. Every error names the method,
the url, and the status with an excerpt of the body. The jitter draws from a private RNG, so retries
never shift a run's random streams, and the API key is sent as a header only, never logged.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import email.utils
import json
import logging
import os
import random
import threading
import time
from collections.abc import Coroutine, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

import httpx

from retrain.errors import UserError
from retrain.housekeeping.digits import whole_number
from retrain.inference.base import SamplingInterrupted
from retrain.inference.config import HttpEngineConfig, check_request_limits
from retrain.waiting import result_of

log = logging.getLogger(__name__)

T = TypeVar("T")

RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
# the connection failed or dropped before an answer: safe to send again
RETRY_ERRORS = (
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.PoolTimeout,
    httpx.ReadError,
    httpx.WriteError,
    httpx.RemoteProtocolError,
)
BODY_EXCERPT_CHARS = 300
MIB = 2**20


class HttpError(UserError):
    """A request failed for good: the server refused it, kept failing, or never answered."""

    def __init__(self, method: str, url: str, problem: str, status: int | None = None, body: str = "") -> None:
        super().__init__(f"{method} {url}: {problem}")
        self.url = url
        self.status = status  # None when no answer came
        self.body = body


def excerpt(text: str) -> str:
    """The start of a response body, on one line, for an error message."""
    flat = " ".join(text.split())
    return flat if len(flat) <= BODY_EXCERPT_CHARS else flat[:BODY_EXCERPT_CHARS] + "…"


def api_key_from_env(variable: str) -> str | None:
    """The API key held by environment variable `variable` ('' = the server needs none)."""
    if not variable:
        return None
    key = os.environ.get(variable, "")
    if not key:
        log.info("$%s is unset: requests carry no API key", variable)
    return key or None


def retry_after_s(response: httpx.Response) -> float | None:
    """The server's Retry-After (seconds or an HTTP date) in seconds, None when absent or unreadable."""
    value = response.headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def decode(content: bytes, encoding: str | None) -> Any:
    """The JSON body, or the text for a server that answers in plain text (vLLM's LoRA routes)."""
    try:
        return json.loads(content)
    except ValueError:
        return content.decode(encoding or "utf-8", errors="replace")


class ReplyTooLarge(Exception):
    """A reply grew past the client's byte limit while it was read."""


class HttpClient:
    """Blocking JSON calls to one server, run concurrently on a private event loop (see the module docstring)."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float,
        max_retries: int,
        max_concurrency: int,
        api_key: str | None = None,
        backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        max_reply_bytes: int = int(HttpEngineConfig.max_reply_mb * MIB),
    ) -> None:
        check_request_limits(timeout_s, max_retries, max_concurrency)
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.max_reply_bytes = max_reply_bytes
        self._interruptible: set[Future[Any]] = set()  # post_all calls in flight (see interrupt)
        self._interrupts = 0  # interrupt() calls so far: one that lands while a call is being registered cancels it
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._jitter = random.Random()  # private: the run's random streams stay untouched
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="retrain-http", daemon=True)
        self._thread.start()
        self._closed = False

        async def open_client() -> tuple[httpx.AsyncClient, asyncio.Semaphore]:
            # made on the loop that uses them
            client = httpx.AsyncClient(
                base_url=self.base_url,
                headers=headers,
                timeout=timeout_s,
                limits=httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency),
            )
            return client, asyncio.Semaphore(max_concurrency)

        self._client, self._slots = self._run(open_client())

    def get(self, path: str, *, max_retries: int | None = None) -> Any:
        return self._run(self._request("GET", path, None, max_retries))

    def post(self, path: str, body: dict[str, Any], *, max_retries: int | None = None) -> Any:
        return self._run(self._request("POST", path, body, max_retries))

    def post_all(self, path: str, bodies: Sequence[dict[str, Any]]) -> list[Any]:
        """POST every body concurrently; the answers in the order of `bodies`. The first failure
        cancels the others and is raised."""

        async def all_of() -> list[Any]:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(self._request("POST", path, body, None)) for body in bodies]
            return [task.result() for task in tasks]

        try:
            return self._run(all_of(), interruptible=True)
        except ExceptionGroup as group:
            raise group.exceptions[0] from None

    def interrupt(self) -> None:
        """Cancel the `post_all` calls in flight: each raises SamplingInterrupted in its caller.

        Safe from a signal handler and from any thread (a stop request during a stuck step); single
        `get`/`post` calls (weight loading, the freshness probe) are left to finish or time out."""
        self._interrupts += 1
        for future in list(self._interruptible):
            future.cancel()

    def close(self) -> None:
        """Cancel what is still in flight, close the connections and stop the loop (idempotent)."""
        if self._closed:
            return

        async def shut_down() -> None:
            # a request left running (a caller interrupted by KeyboardInterrupt) ends here, not as
            # asyncio's "Task was destroyed but it is pending" when the loop closes under it
            pending = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            await self._client.aclose()

        try:
            self._run(shut_down())
        finally:
            self._closed = True
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()

    def _run(self, coroutine: Coroutine[Any, Any, T], interruptible: bool = False) -> T:
        if self._closed:
            coroutine.close()
            raise RuntimeError(f"the HTTP client of {self.base_url} is closed")
        interrupts = self._interrupts
        future: Future[T] = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        if interruptible:
            self._interruptible.add(future)
            if self._interrupts != interrupts:  # a stop request came after the requests went out, before the add
                future.cancel()
        try:
            return result_of(future)
        except concurrent.futures.CancelledError:
            raise SamplingInterrupted(f"requests to {self.base_url} cancelled by a stop request") from None
        finally:
            self._interruptible.discard(future)

    async def _attempt(self, method: str, path: str, body: dict[str, Any] | None) -> tuple[httpx.Response, bytes]:
        """One request and its whole reply, read streamed within `timeout_s` and `max_reply_bytes`."""
        async with asyncio.timeout(self.timeout_s):
            async with self._client.stream(method, path, json=body) as response:
                declared = response.headers.get("content-length", "")
                if (whole_number(declared) or 0) > self.max_reply_bytes:
                    raise ReplyTooLarge
                chunks, size = [], 0
                async for chunk in response.aiter_bytes():  # decoded: a gzip bomb counts as what it inflates to
                    size += len(chunk)
                    if size > self.max_reply_bytes:
                        raise ReplyTooLarge
                    chunks.append(chunk)
                return response, b"".join(chunks)

    async def _request(self, method: str, path: str, body: dict[str, Any] | None, max_retries: int | None) -> Any:
        url = self.base_url + path
        retries = self.max_retries if max_retries is None else max_retries
        attempt = 0
        while True:
            status, text, wait = None, "", None
            try:
                async with self._slots:  # waiting for a slot is not part of the request's time
                    response, content = await self._attempt(method, path, body)
            except RETRY_ERRORS as error:
                problem = f"{type(error).__name__}: {str(error) or 'connection failed'}"
            except (httpx.TimeoutException, TimeoutError):
                problem = (
                    f"no complete answer within {self.timeout_s:g} s (raise inference.timeout_s for long generations)"
                )
                raise HttpError(method, url, problem) from None
            except ReplyTooLarge:
                problem = (
                    f"the reply is larger than {self.max_reply_bytes / MIB:g} MiB (inference.max_reply_mb); "
                    "it was not read further"
                )
                raise HttpError(method, url, problem) from None
            except httpx.HTTPError as error:
                raise HttpError(method, url, f"{type(error).__name__}: {error}") from None
            else:
                if response.is_success:
                    return decode(content, response.encoding)
                status, text = response.status_code, content.decode(response.encoding or "utf-8", errors="replace")
                problem = f"answered {status}: {excerpt(text)}"
                if status not in RETRY_STATUSES:
                    raise HttpError(method, url, problem, status, text)
                wait = retry_after_s(response)
            if attempt >= retries:
                raise HttpError(method, url, f"{problem} (after {attempt + 1} attempts)", status, text)
            delay = min(self.max_backoff_s, wait if wait is not None else self._backoff(attempt))
            log.warning("%s %s: %s; retrying in %.2f s (%d/%d)", method, url, problem, delay, attempt + 1, retries)
            await asyncio.sleep(delay)
            attempt += 1

    def _backoff(self, attempt: int) -> float:
        """Exponential backoff with jitter: in [½, 1] × backoff_s · 2^attempt, capped."""
        ceiling = min(self.max_backoff_s, self.backoff_s * 2**attempt)
        return ceiling * (0.5 + 0.5 * self._jitter.random())
