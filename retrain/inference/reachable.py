"""A cheap request to the inference server before anything loads.

A server engine first talks to its server when it is built, after the data set, the tokenizer and
the model have loaded (minutes for a large model). One GET of the server's root first finds a dead
server or a wrong `inference.url` in seconds. Any HTTP answer, even 404, proves a server listens.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from retrain.errors import UserError
from retrain.inference.config import server_urls
from retrain.inference.http import HttpClient, HttpError

PING_TIMEOUT_S = 30.0  # the root of a live server answers at once, busy or not


def check_server_answers(settings: Mapping[str, Any]) -> None:
    """UserError naming `inference.url` when the server there does not answer (after `inference.max_retries`)."""
    url = settings.get("url")
    if not url:
        return
    timeout_s = min(float(settings.get("timeout_s", PING_TIMEOUT_S)), PING_TIMEOUT_S)
    for base_url in server_urls(url):
        client = HttpClient(
            base_url, timeout_s=timeout_s, max_retries=int(settings.get("max_retries", 0)), max_concurrency=1
        )
        try:
            client.get("/")
        except HttpError as error:
            if error.status is None:
                raise UserError(f"inference.url: no server answers ({error}); start it, or fix the url") from None
        finally:
            client.close()
