"""Hub ids vs local paths, and failing fast, with directions, when the Hub cannot be reached."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
from huggingface_hub import constants as hub_constants

from retrain.data.config import Gsm8kDataConfig
from retrain.errors import ConfigError, HubFetchError
from retrain.hub import hub_fetch, hub_reachable, local_path

REPO = Path(__file__).resolve().parents[2]
OFFLINE_BOUND_S = 10.0


def closed_loopback_url() -> str:
    """An http URL on 127.0.0.1 where nothing listens (the port was just free)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def load_in_subprocess(code: str, env: dict[str, str]) -> tuple[subprocess.CompletedProcess[str], float]:
    """Run `code` in a fresh interpreter (the libraries read HF_* variables at import)."""
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO), **env},
    )
    return result, time.monotonic() - started


LOAD_DEFAULT_MATH = """
import time
from retrain.data.config import MathDataConfig
from retrain.data.math import MathData
from retrain.errors import HubFetchError
started = time.monotonic()
try:
    MathData(MathDataConfig(), seed=0)
except HubFetchError as exc:
    print(f"{time.monotonic() - started:.3f}")
    print(exc)
"""


def test_local_paths_and_hub_ids(tmp_path: Path) -> None:
    data_file = tmp_path / "d.jsonl"
    data_file.write_text("{}\n")
    assert local_path(str(data_file), "data.path") == data_file
    assert local_path(str(tmp_path), "data.path") == tmp_path
    assert local_path("EleutherAI/hendrycks_math", "data.path") is None
    assert local_path("gpt2", "model.name_or_path") is None
    for missing in ["./data/train.jsonl", "train.jsonl", "/no/such/dir", "~/no_such_dir", "org/name/extra", "a b"]:
        with pytest.raises(ConfigError, match=f"model.name_or_path={missing!r}: no such file"):
            local_path(missing, "model.name_or_path")


def test_the_probe_sees_a_live_server_and_a_dead_port() -> None:
    class Ok(BaseHTTPRequestHandler):
        def do_HEAD(self) -> None:
            self.send_response(404)  # any status means someone is there
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Ok)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert hub_reachable(f"http://127.0.0.1:{server.server_address[1]}")
    finally:
        server.shutdown()
        server.server_close()
    started = time.monotonic()
    assert not hub_reachable(closed_loopback_url())
    assert time.monotonic() - started < 4.0


def test_an_unreachable_hub_fails_fast_with_directions() -> None:
    result, elapsed = load_in_subprocess(
        LOAD_DEFAULT_MATH, {"HF_ENDPOINT": closed_loopback_url(), "HF_HUB_OFFLINE": "0"}
    )
    assert result.returncode == 0, result.stderr[-3000:]
    seconds, message = result.stdout.split("\n", 1)
    assert float(seconds) < OFFLINE_BOUND_S and elapsed < 30
    assert "Could not fetch dataset 'EleutherAI/hendrycks_math'" in message
    assert "is unreachable" in message
    assert "python -m retrain experiment=quickstart" in message and "data.path" in message


def test_offline_mode_fails_fast_with_directions() -> None:
    result, _ = load_in_subprocess(LOAD_DEFAULT_MATH, {"HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    seconds, message = result.stdout.split("\n", 1)
    assert float(seconds) < OFFLINE_BOUND_S
    assert "'EleutherAI/hendrycks_math'" in message and "experiment=quickstart" in message
    assert "HF_HUB_OFFLINE is set, and the Hugging Face cache holds no copy" in message


def test_loading_the_default_hub_id_here_fails_within_seconds() -> None:
    if hub_reachable(hub_constants.ENDPOINT):
        pytest.skip("the Hugging Face Hub is reachable from here; this checks the offline behaviour")
    from retrain.data.gsm8k import Gsm8kData

    started = time.monotonic()
    with pytest.raises(HubFetchError, match="(?s)dataset 'openai/gsm8k'.*experiment=quickstart"):
        Gsm8kData(Gsm8kDataConfig(), seed=0)
    assert time.monotonic() - started < OFFLINE_BOUND_S


def test_fetch_errors_inside_the_guard_become_hub_fetch_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)  # as HF_HUB_OFFLINE=1: no probe
    with (
        pytest.raises(
            HubFetchError, match="(?s)model 'org/some-model'.*ConnectionError: refused.*model.name_or_path"
        ) as caught,
        hub_fetch("org/some-model", "model", "model.name_or_path"),
    ):
        raise ConnectionError("refused")
    assert isinstance(caught.value, RuntimeError) and isinstance(caught.value.__cause__, ConnectionError)
