"""backend=prime_rl against a stand-in for the PRIME-RL trainer: a thread that reads what retrain sends
where PRIME-RL's trainer reads it, decodes it with PRIME-RL's message types, and broadcasts new weights
as that trainer does (files, then STABLE)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from retrain.backend.capabilities import describe_backend
from retrain.backend.prime_rl.messages import MicroBatch, decode_rank
from retrain.backend.prime_rl.weights import STABLE, broadcast_dir, wait_for_broadcast
from retrain.errors import ConfigError, UserError
from retrain.model.logprobs import completion_logprobs
from retrain.model.probe import Probe
from retrain.training.metrics_log import console_line
from tests.backend.prime_rl_helpers import SPEC, make_backend, train_batch, write_broadcast
from tests.backend.tiny_model import tokenizer_of


def test_wait_for_broadcast_polls_until_stable(tmp_path):
    directory = tmp_path / "broadcasts" / "step_1"

    def trainer() -> None:  # the files first, STABLE after a while, as PRIME-RL writes them
        directory.mkdir(parents=True)
        time.sleep(0.3)
        (directory / STABLE).touch()

    writer = threading.Thread(target=trainer)
    start = time.monotonic()
    writer.start()
    assert wait_for_broadcast(directory, wait_s=10.0, poll_s=0.02) == directory
    writer.join()
    assert 0.25 < time.monotonic() - start < 5.0


def test_wait_for_broadcast_gives_up_naming_the_directory(tmp_path):
    directory = tmp_path / "broadcasts" / "step_4"
    directory.mkdir(parents=True)  # files but no STABLE: an incomplete broadcast
    with pytest.raises(UserError, match=f"no complete PRIME-RL broadcast at {directory}.*backend.sync_wait_s=0.2"):
        wait_for_broadcast(directory, wait_s=0.2, poll_s=0.05)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"strict_advantages": False},
            "backend.strict_advantages=False: must stay true: retrain never averages a row's token-level advantages",
        ),
        ({"transport": "nfs"}, "backend.transport='nfs' is not one of: filesystem, zmq"),
        ({"sync_poll_s": 0.0}, "backend.sync_poll_s"),
    ],
)
def test_bad_options_are_refused_naming_the_key(tmp_path, options, message):
    """Checked where the run's parts are planned (retrain.run.plan_parts), before anything is built."""
    with pytest.raises(ConfigError, match=message):
        describe_backend("retrain.backend.prime_rl.backend.PrimeRlBackend").check_options(
            {"output_dir": str(tmp_path), **options}
        )


def test_an_inference_url_that_is_no_http_url_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="backend.inference_url='localhost:8000' is not an http"):
        make_backend(tmp_path, inference_url="localhost:8000")


def test_an_empty_output_dir_is_refused():
    with pytest.raises(ConfigError, match="backend.output_dir is required: the PRIME-RL trainer's output_dir"):
        describe_backend("retrain.backend.prime_rl.backend.PrimeRlBackend").check_options({"output_dir": ""})


def fake_prime_rl_trainer(output_dir: Path, steps: int, received: list[list[MicroBatch]]) -> threading.Thread:
    """Reads rollouts/step_N/rank_0.bin as PRIME-RL's FileSystemMicroBatchReceiver does, then broadcasts step N."""

    def run() -> None:
        for step in range(1, steps + 1):
            path = output_dir / "rollouts" / f"step_{step}" / "rank_0.bin"
            deadline = time.monotonic() + 30
            while not path.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            received.append(decode_rank(path.read_bytes()))
            write_broadcast(broadcast_dir(output_dir, step), seed=step)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_step_goes_to_prime_rl_and_its_broadcast_comes_back(tmp_path):
    backend = make_backend(tmp_path, sync_poll_s=0.02)
    received: list[list[MicroBatch]] = []
    trainer = fake_prime_rl_trainer(tmp_path, steps=2, received=received)
    first = backend.train(train_batch())
    second = backend.train(train_batch())
    trainer.join()
    assert first.update is not None and first.update.version == 1
    assert first.update.adapter_dir == broadcast_dir(tmp_path, 1)
    assert second.update is not None and second.update.version == 2
    assert first.loss == 0.0 and first.num_tokens == 2 + 3 + 1
    assert [sum(mb.loss_mask) for mb in received[0]] == [6]
    assert received[0][0].advantages == [0, 0, -0.5, -0.5, -0.5, 0, 0, 0.5, 0.5, 0, 0, 0, 1.0]  # longest first
    assert "loss=0.0000 (placeholder)" in console_line(
        {"step": 0, "loss": first.loss, "mean_reward": 0.5, "correct_rate": 0.5, "num_datums": 3,
         "batch_size": 2, "group_size": 2, "step_time_s": 1.0}, "maxrl+none", placeholder_loss=True,
    )  # fmt: skip
    backend.close()


def test_a_batch_without_rows_takes_no_step(tmp_path):
    backend = make_backend(tmp_path)
    batch = train_batch()
    batch.row_mask[:] = False
    result = backend.train(batch)
    assert result.update is None and result.num_tokens == 0 and backend.step == 0


def reference_logprobs(directory: Path, probe: Probe) -> torch.Tensor:
    """The probe scored by PEFT itself, straight from the broadcast's files."""
    base = AutoModelForCausalLM.from_pretrained(SPEC.source()[0], dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(directory)).eval()
    prompt, completion = torch.tensor([probe.prompt_ids]), torch.tensor([probe.completion_ids])
    with torch.no_grad():
        return completion_logprobs(
            model, prompt, torch.ones_like(prompt, dtype=torch.bool), torch.zeros(1, dtype=torch.long),
            completion, torch.ones_like(completion, dtype=torch.bool), 1.0,
        )[0]  # fmt: skip


def test_probe_scores_the_broadcast_weights_and_resume_restores_them(tmp_path):
    probe = Probe.from_tokenizer(tokenizer_of(SPEC.name_or_path))
    backend = make_backend(tmp_path, sync_poll_s=0.02)
    base = backend.probe_logprobs(probe)
    trainer = fake_prime_rl_trainer(tmp_path, steps=1, received=[])
    update = backend.train(train_batch()).update
    trainer.join()
    assert update is not None and update.adapter_dir is not None
    trained = backend.probe_logprobs(probe)
    assert torch.allclose(trained, reference_logprobs(update.adapter_dir, probe), atol=1e-5)
    assert (trained - base).abs().max() > 1e-3  # the broadcast moved the probe: the check has teeth
    backend.save(tmp_path / "checkpoint")
    backend.close()

    resumed = make_backend(tmp_path, sync_poll_s=0.02)
    restored = resumed.load(tmp_path / "checkpoint")
    assert restored.version == 1 and restored.adapter_dir == update.adapter_dir
    assert torch.allclose(resumed.probe_logprobs(probe), trained, atol=1e-6)
    elsewhere = make_backend(tmp_path / "other")
    with pytest.raises(ConfigError, match="resume with the same PRIME-RL output_dir"):
        elsewhere.load(tmp_path / "checkpoint")
