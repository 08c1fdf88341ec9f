"""What every engine that samples on a server sets up the same way: its client, the route it samples on,
and the tokenizer facts its reply checks need (stop ids, vocabulary size)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from retrain.inference.completions import stop_token_ids
from retrain.inference.config import HttpEngineConfig, check_url
from retrain.inference.http import MIB, HttpClient, api_key_from_env
from retrain.inference.replies import ServerRoute, vocab_size
from retrain.model.resources import EngineResources


class ServerEngine:
    """The shared part of vllm_server, sglang and openai: built from `inference.*` (`HttpEngineConfig`)."""

    def __init__(
        self, config: HttpEngineConfig, tokenizer: Any, resources: EngineResources, engine: str, route: str
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.stop_ids = stop_token_ids(tokenizer, getattr(resources.model, "generation_config", None))
        self.vocab_size = vocab_size(tokenizer, resources.model)
        self.client = HttpClient(
            check_url(config.url),
            timeout_s=config.timeout_s,
            max_retries=config.max_retries,
            max_concurrency=config.max_concurrency,
            api_key=api_key_from_env(config.api_key_env),
            max_reply_bytes=int(config.max_reply_mb * MIB),
        )
        self.url = self.client.base_url
        self.route = ServerRoute(engine, self.url + route)

    @contextmanager
    def closed_on_failure(self) -> Iterator[None]:
        """Close the client when the rest of the engine's start-up fails (the server answered, the run will not)."""
        try:
            yield
        except BaseException:
            self.client.close()
            raise
