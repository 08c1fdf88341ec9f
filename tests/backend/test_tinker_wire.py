"""The real Tinker SDK, pointed by backend.base_url at an HTTP server on 127.0.0.1, sends its first
request as documented: POST /api/v1/client/config with the key from TINKER_API_KEY in X-API-Key and
the SDK's version in the body. The server refuses the key; the run fails with a one-line error."""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest

from retrain.backend.settings import LossSettings, OptimSettings
from retrain.backend.tinker.backend import TinkerBackend
from retrain.backend.tinker.calls import TinkerAuthError
from retrain.backend.tinker.config import TinkerBackendConfig
from retrain.model.spec import ModelSpec

tinker = pytest.importorskip("tinker")

KEY = "tml-loopback-secret"


class Refusing(BaseHTTPRequestHandler):
    """Records each request and answers 401 (an unknown key)."""

    received: ClassVar[list[dict[str, Any]]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.received.append(
            {"method": "POST", "path": self.path, "headers": dict(self.headers), "body": json.loads(body or b"{}")}
        )
        payload = json.dumps({"detail": "Invalid API key"}).encode()
        self.send_response(401)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def server() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    received: ClassVar[list[dict[str, Any]]] = []
    handler = type("Handler", (Refusing,), {"received": received})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", received
    httpd.shutdown()
    httpd.server_close()


def test_the_sdk_first_request_carries_the_key_and_a_refusal_is_a_clear_error(
    server: tuple[str, list[dict[str, Any]]], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    url, received = server
    assert sys.modules["tinker"] is tinker  # the real SDK, no fake
    monkeypatch.setenv("TINKER_API_KEY", KEY)
    monkeypatch.delenv("TINKER_BASE_URL", raising=False)
    with pytest.raises(TinkerAuthError, match="TINKER_API_KEY.*HTTP 401") as error:
        TinkerBackend(
            TinkerBackendConfig(base_url=url, lock_dir=str(tmp_path), retry_backoff_s=0.0),
            model=ModelSpec(name_or_path="Qwen/Qwen3-4B-Instruct-2507"),
            optim=OptimSettings(lr=1e-5, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8, max_grad_norm=1.0),
            loss=LossSettings(clip_eps=0.0, clip_eps_high=None),
            seed=0,
        )
    assert KEY not in str(error.value)
    first = received[0]
    assert (first["method"], first["path"]) == ("POST", "/api/v1/client/config")
    assert first["headers"]["X-API-Key"] == KEY
    assert first["body"] == {"sdk_version": tinker.__version__}
    assert len([r for r in received if r["path"] == "/api/v1/client/config"]) == 1  # a 401 is not retried
