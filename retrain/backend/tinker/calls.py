"""Every Tinker SDK call goes through here: the SDK import, the cross-process concurrency limit,
bounded retries of what the SDK itself counts as retryable, and one-line errors for the rest.

The SDK already retries transient failures inside a request; what still escapes it (a 429 or 5xx
streak, a dropped connection) is retried here a bounded number of times with exponential backoff,
each attempt holding one slot of the limiter. What cannot succeed by retrying (a rejected key, an
unknown model, a malformed request) fails at once as a `UserError` whose message says what to fix.
"""

from __future__ import annotations

import importlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from retrain.backend.tinker.limiter import FileSemaphore
from retrain.errors import ConfigError, UserError
from retrain.waiting import result_of

log = logging.getLogger(__name__)

T = TypeVar("T")

API_KEY_ENV = "TINKER_API_KEY"
BASE_URL_ENV = "TINKER_BASE_URL"
MAX_BACKOFF_S = 60.0
INSTALL_HINT = "pip install 'retrain[tinker]'"


class TinkerServiceError(UserError, RuntimeError):
    """The Tinker service refused or failed a request (after the retries it deserved)."""


class TinkerAuthError(TinkerServiceError):
    """The service rejected the API key in TINKER_API_KEY (HTTP 401/403)."""


class TinkerRateLimitError(TinkerServiceError):
    """The service kept answering 429 after every retry."""


def load_sdk() -> Any:
    """The `tinker` package (imported here, not at module level, so `retrain backends` lists
    backend=tinker without the extra installed)."""
    try:
        return importlib.import_module("tinker")
    except ImportError as error:
        raise ConfigError(f"backend=tinker needs the Tinker SDK, which is not installed: {INSTALL_HINT}") from error


def status_code(error: BaseException) -> int | None:
    code = getattr(error, "status_code", None)
    return code if isinstance(code, int) else None


def refused_as_invalid(error: BaseException) -> bool:
    """The service found the request itself wrong (400/404/422, or a failed request it blames on the
    caller): for a create call, the model or the checkpoint named is not one it serves."""
    if status_code(error) in (400, 404, 422):
        return True
    category = getattr(error, "category", None)
    return category is not None and str(getattr(category, "value", category)).lower() == "user"


class RemoteCalls:
    """Runs SDK calls under the concurrency limit, retrying what the SDK calls retryable."""

    def __init__(self, sdk: Any, limiter: FileSemaphore, max_retries: int, backoff_s: float, api_key: str) -> None:
        self.sdk = sdk
        self.limiter = limiter
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self._api_key = api_key
        self._pool = ThreadPoolExecutor(limiter.slots, "retrain-tinker")

    def run(self, what: str, call: Callable[[], T], retry: bool = True) -> T:
        """`call()` submits a request and waits for its result; `what` names it in messages ("sampling").
        `retry=False` for a call that must not be sent twice (the SDK's own retries still apply)."""
        attempts = self.max_retries + 1 if retry else 1
        for attempt in range(attempts):
            try:
                with self.limiter.slot():
                    return call()
            except Exception as error:  # sorted out below: a bug in us is re-raised as is
                if not self._retryable(error) or attempt == attempts - 1:
                    raise self._failure(what, error, attempt) from error
                delay = min(self.backoff_s * 2**attempt, MAX_BACKOFF_S)
                log.warning(
                    "Tinker %s failed (%s); retry %d/%d in %.1fs",
                    what,
                    self._said(error),
                    attempt + 1,
                    self.max_retries,
                    delay,
                )
                time.sleep(delay)
        raise AssertionError("unreachable: the last attempt returns or raises")

    def map(self, what: str, calls: list[Callable[[], T]]) -> list[T]:
        """Run independent calls concurrently (as many at once as the limit allows); results in order."""
        futures = [self._pool.submit(self.run, what, call) for call in calls]
        return [result_of(future) for future in futures]

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def _retryable(self, error: Exception) -> bool:
        if isinstance(error, self.sdk.APIConnectionError):  # timeouts included
            return True
        code = status_code(error) if isinstance(error, self.sdk.APIStatusError) else None
        return code is not None and (code in (408, 409, 429) or code >= 500)

    def _said(self, error: BaseException) -> str:
        """The error's message, never holding the key."""
        text = f"{type(error).__name__}: {error}"
        return text.replace(self._api_key, "***") if self._api_key else text

    def _failure(self, what: str, error: Exception, retries: int) -> Exception:
        sdk = self.sdk
        if not isinstance(error, sdk.TinkerError):
            return error  # not the service's doing: a bug, keep its traceback
        said = self._said(error)
        if isinstance(error, (sdk.AuthenticationError, sdk.PermissionDeniedError)):
            return TinkerAuthError(
                f"Tinker rejected the API key in {API_KEY_ENV} while {what} (HTTP {status_code(error)}): {said}; "
                f"check the key and the service URL (backend.base_url or {BASE_URL_ENV})"
            )
        if isinstance(error, sdk.RateLimitError):
            return TinkerRateLimitError(
                f"Tinker rate limit (HTTP 429) still hit while {what} after {retries} retries: {said}; lower "
                "backend.max_concurrent_calls, raise backend.max_retries, or try again later"
            )
        if isinstance(error, sdk.APIConnectionError):
            return TinkerServiceError(
                f"cannot reach the Tinker service while {what} after {retries} retries: {said}; check the network "
                f"and the service URL (backend.base_url or {BASE_URL_ENV})"
            )
        return TinkerServiceError(f"Tinker failed while {what}: {said}")
