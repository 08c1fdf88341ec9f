"""A loopback OpenAI-compatible HTTP server over any retrain InferenceEngine, so programs that only speak
HTTP (verifiers environments, their harnesses) sample from the run's own policy.

It serves the token-in/token-out route that verifiers' training client calls (vLLM's
`POST /inference/v1/generate`: prompt token ids and sampling params in; completion token ids, one
`token_id:N` log-prob entry per token, and the finish reason out) and `GET /v1/models` (one model, the
served policy). Every request becomes one `engine.generate` call on the chat-templated prompt ids the
client sent, with the request's seed; calls are serialised, since an engine samples one batch at a
time. It listens on 127.0.0.1 only, on a free port, in a daemon thread, and `close()` stops it.

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
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from retrain.inference.base import InferenceEngine
from retrain.types import SamplingParams

log = logging.getLogger(__name__)

GENERATE = "/inference/v1/generate"
MODELS = "/v1/models"
SERVED_MODEL = "policy"  # the name clients ask for; there is only the run's policy
TOKEN_ID_PREFIX = "token_id:"  # how vLLM spells a token in `logprobs.content[i].token`


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
        self._engine_lock = threading.Lock()
        self._server = EndpointServer(("127.0.0.1", 0), _handler(self))
        self._thread = threading.Thread(target=self._server.serve_forever, name="retrain-endpoint", daemon=True)
        self._thread.start()
        log.info("Engine endpoint for environments at %s", self.url)

    @property
    def url(self) -> str:
        """The OpenAI-style base url (ending in /v1)."""
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1"

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
        with self._engine_lock:
            rollouts = self.engine.generate([prompt], 1, sampling, seed)
        length = int(rollouts.completion_mask[0].sum())
        ids = rollouts.completion_ids[0, :length].tolist()
        logprobs = rollouts.logprobs[0, :length].tolist()
        return {
            "request_id": uuid.uuid4().hex,
            "prompt_token_ids": prompt,
            "choices": [
                {
                    "index": 0,
                    "token_ids": ids,
                    "finish_reason": "length" if bool(rollouts.hit_max_tokens[0]) else "stop",
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


def _handler(endpoint: EngineEndpoint) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # one line per request would flood the run log
            log.debug("endpoint: " + format, *args)

        def do_GET(self) -> None:
            if self.path.rstrip("/") == MODELS:
                self._answer(200, endpoint.models())
            else:
                self._answer(404, {"error": {"message": f"no route GET {self.path}"}})

        def do_POST(self) -> None:
            if self.path.rstrip("/") != GENERATE:
                self._answer(404, {"error": {"message": f"no route POST {self.path} (only {GENERATE})"}})
                return
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                if not isinstance(body, dict):
                    raise RequestError("the body must be a JSON object")
                self._answer(200, endpoint.generate(body))
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
