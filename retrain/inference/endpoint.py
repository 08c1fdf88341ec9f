"""A loopback OpenAI-compatible HTTP server over any retrain InferenceEngine, so programs that only speak
HTTP (verifiers environments, their harnesses, a user's agent) sample from the run's own policy.

It serves the token-in/token-out route that verifiers' training client calls (vLLM's
`POST /inference/v1/generate`: prompt token ids and sampling params in; completion token ids, one
`token_id:N` log-prob entry per token, and the finish reason out), `GET /v1/models` (one model, the
served policy), and, for each agent episode in flight (data=agent), `POST /episodes/<key>/v1/chat/completions`,
answered by the handler the episode registered (retrain.environments.chat_episode). Every request becomes one
TokenRequest with the request's seed; requests in flight together are sampled in one engine batch
(retrain.inference.request_batcher). It listens on 127.0.0.1 only, on a free port, in a daemon thread, and
`close()` stops it.

Its listen backlog is the system's maximum, not socketserver's 5: an environment opens a connection per
rollout in flight (16 by default) at the same moment, and a full backlog resets some of them, which
verifiers records as a failed episode ("Connection error").
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import uuid
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from retrain.inference.base import InferenceEngine
from retrain.inference.completions import Completion
from retrain.inference.request_batcher import RequestBatcher
from retrain.inference.requests import TokenRequest
from retrain.types import SamplingParams

log = logging.getLogger(__name__)

GENERATE = "/inference/v1/generate"
MODELS = "/v1/models"
SERVED_MODEL = "policy"  # the name clients ask for; there is only the run's policy
TOKEN_ID_PREFIX = "token_id:"  # how vLLM spells a token in `logprobs.content[i].token`
EPISODES = "/episodes/"  # an agent episode's base url: /episodes/<key>/v1
CHAT = "/v1/chat/completions"

ChatHandler = Callable[[dict[str, Any]], dict[str, Any]]  # a chat completions request body -> its response


class RequestError(ValueError):
    """A request the endpoint cannot serve (answered 400 with this message)."""


def sampling_of(params: dict[str, Any]) -> tuple[SamplingParams, int | None]:
    """The engine's sampling settings and seed from a request's `sampling_params` (vLLM's names)."""
    if params.get("n", 1) != 1:
        raise RequestError("sampling_params.n must be 1: send one request per completion")
    max_tokens = params.get("max_tokens")
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise RequestError(f"sampling_params.max_tokens must be a positive integer, got {max_tokens!r}")
    temperature = float(params["temperature"]) if params.get("temperature") is not None else 1.0
    top_p = float(params["top_p"]) if params.get("top_p") is not None else 1.0
    if temperature < 0:
        raise RequestError(f"sampling_params.temperature must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise RequestError(f"sampling_params.top_p must be in (0, 1], got {top_p}")
    seed = params.get("seed")
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p), (
        None if seed is None else int(seed)
    )


class EndpointServer(ThreadingHTTPServer):
    """A threading HTTP server whose backlog holds every connection an environment opens at once."""

    request_queue_size = socket.SOMAXCONN
    daemon_threads = True


class EngineEndpoint:
    """Serves `engine` over HTTP on a loopback port until `close()` (see the module docstring)."""

    def __init__(self, engine: InferenceEngine, max_model_len: int | None = None) -> None:
        self.engine = engine
        self.max_model_len = max_model_len
        self.batcher = RequestBatcher(engine)
        self._episodes: dict[str, ChatHandler] = {}
        self._server = EndpointServer(("127.0.0.1", 0), _handler(self))
        self._thread = threading.Thread(target=self._server.serve_forever, name="retrain-endpoint", daemon=True)
        self._thread.start()
        log.info("Engine endpoint for environments at %s", self.url)

    @property
    def url(self) -> str:
        """The OpenAI-style base url (ending in /v1)."""
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    def serve_episode(self, key: str, handler: ChatHandler) -> str:
        """Answer `/episodes/<key>/v1/chat/completions` with `handler` until `end_episode(key)`; returns the
        episode's base url (what an agent's OpenAI client takes as base_url)."""
        self._episodes[key] = handler
        return f"{self.url.removesuffix('/v1')}{EPISODES}{key}/v1"

    def end_episode(self, key: str) -> None:
        """Later requests of the episode are refused (404): an abandoned agent cannot add to a finished row."""
        self._episodes.pop(key, None)

    def complete(self, request: TokenRequest) -> Completion:
        """The engine's completion of one request, sampled with the others in flight."""
        return self.batcher.complete(request)

    def chat(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """Answer an episode's chat completions request (`path`: /episodes/<key>/v1/chat/completions)."""
        key = path[len(EPISODES) :].removesuffix(CHAT)
        handler = self._episodes.get(key)
        if handler is None:
            raise UnknownEpisode(f"episode {key!r} is not in flight (it ended, or timed out and was abandoned)")
        return handler(body)

    def models(self) -> dict[str, Any]:
        card: dict[str, Any] = {"id": SERVED_MODEL, "object": "model", "owned_by": "retrain"}
        if self.max_model_len is not None:
            card["max_model_len"] = self.max_model_len
        return {"object": "list", "data": [card]}

    def generate(self, body: dict[str, Any]) -> dict[str, Any]:
        """Answer one `/inference/v1/generate` request."""
        prompt = body.get("token_ids")
        if not isinstance(prompt, list) or not prompt or not all(isinstance(t, int) for t in prompt):
            raise RequestError("token_ids must be a non-empty list of token ids (this endpoint takes no text)")
        sampling, seed = sampling_of(body.get("sampling_params") or {})
        completion = self.complete(TokenRequest(prompt, sampling, seed))
        ids, logprobs = completion.token_ids, completion.logprobs
        return {
            "request_id": uuid.uuid4().hex,
            "prompt_token_ids": prompt,
            "choices": [
                {
                    "index": 0,
                    "token_ids": ids,
                    "finish_reason": "length" if completion.hit_max_tokens else "stop",
                    "logprobs": {
                        "content": [
                            {"token": f"{TOKEN_ID_PREFIX}{token}", "logprob": value}
                            for token, value in zip(ids, logprobs)
                        ]
                    },
                }
            ],
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": len(ids),
                "total_tokens": len(prompt) + len(ids),
            },
        }

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
        self.batcher.close()


class UnknownEpisode(LookupError):
    """A request for an episode that is not in flight (answered 404)."""


def _handler(endpoint: EngineEndpoint) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # one line per request would flood the run log
            log.debug("endpoint: " + format, *args)

        def do_GET(self) -> None:
            if self.path.rstrip("/") == MODELS or (
                self.path.startswith(EPISODES) and self.path.rstrip("/").endswith(MODELS)
            ):
                self._answer(200, endpoint.models())
            else:
                self._answer(404, {"error": {"message": f"no route GET {self.path}"}})

        def do_POST(self) -> None:
            path = self.path.rstrip("/")
            chat = path.startswith(EPISODES) and path.endswith(CHAT)
            if path != GENERATE and not chat:
                self._answer(
                    404,
                    {"error": {"message": f"no route POST {self.path} (only {GENERATE}, and {CHAT} of an episode)"}},
                )
                return
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                if not isinstance(body, dict):
                    raise RequestError("the body must be a JSON object")
                self._answer(200, endpoint.chat(path, body) if chat else endpoint.generate(body))
            except UnknownEpisode as error:
                self._answer(404, {"error": {"message": str(error)}})
            except (RequestError, json.JSONDecodeError) as error:
                self._answer(400, {"error": {"message": str(error)}})
            except Exception as error:  # the engine failed: the client sees it, the run log keeps the traceback
                log.exception("endpoint: generate failed")
                self._answer(500, {"error": {"message": f"{type(error).__name__}: {error}"}})

        def _answer(self, status: int, payload: dict[str, Any]) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return Handler
