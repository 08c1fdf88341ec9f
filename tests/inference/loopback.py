"""A real HTTP server on 127.0.0.1 for the tests of the engines that talk to servers.

It stands for the remote service (vLLM, SGLang, an OpenAI-compatible server): each route is a
Python function of the request's JSON body that returns (status, JSON, text or raw bytes, headers);
every request is recorded, headers included.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Any

from retrain.inference.endpoint import EndpointServer

Answer = tuple[int, Any, dict[str, str]]
Route = Callable[[Any], Answer]


def ok(body: Any) -> Answer:
    return 200, body, {}


@dataclass
class Recorded:
    method: str
    path: str
    body: Any
    headers: dict[str, str]


@dataclass
class Loopback:
    """The routes it serves ("METHOD /path" -> Route) and what it was asked."""

    routes: dict[str, Route]
    requests: list[Recorded] = field(default_factory=list)
    url: str = ""

    def asked(self, path: str) -> list[Recorded]:
        return [request for request in self.requests if request.path == path]


@contextmanager
def serve(routes: dict[str, Route]) -> Iterator[Loopback]:
    """Serve `routes` on a free loopback port for the duration of the block; unknown routes answer 404."""
    loopback = Loopback(routes)
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self._answer("GET")

        def do_POST(self) -> None:
            self._answer("POST")

        def _answer(self, method: str) -> None:
            length = int(self.headers.get("content-length") or 0)
            raw = self.rfile.read(length) if length else b""
            body = json.loads(raw) if raw else None
            with lock:
                loopback.requests.append(Recorded(method, self.path, body, dict(self.headers.items())))
            route = loopback.routes.get(f"{method} {self.path}")
            status, payload, headers = route(body) if route else (404, {"detail": "Not Found"}, {})
            if isinstance(payload, bytes):  # sent as it is (e.g. a gzip body with its content-encoding header)
                data = payload
            else:
                data = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
            self.send_response(status)
            if "content-type" not in headers:
                self.send_header("content-type", "text/plain" if isinstance(payload, str) else "application/json")
            self.send_header("content-length", str(len(data)))
            for name, value in headers.items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:  # quiet
            pass

    server = EndpointServer(("127.0.0.1", 0), Handler)  # a backlog that holds a burst of connections
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    loopback.url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield loopback
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
