"""Split mode (`backend.devices='gpu:0,gpu:1'`): sampling of step s+1 overlaps training of step s (max_staleness 1).

The overlap logic is device-agnostic; here it runs on two CPU "devices" (`cpu,cpu`): the engine
samples with its own copy of the weights in a second thread while the backend trains.
"""

from __future__ import annotations

import re
from contextlib import ExitStack
from pathlib import Path

import pytest
import torch

from retrain.backend.devices import resolve_devices
from retrain.backend.local import LocalBackend
from retrain.config import compose
from retrain.errors import ConfigError
from retrain.housekeeping.rundir import Checkpoint
from retrain.model.probe import Probe
from retrain.model.spec import ModelSpec
from retrain.run import build_trainer
from retrain.training.freshness import FreshnessProof
from retrain.training.sampled_ahead import SAMPLED_AHEAD_FILE
from retrain.training.trainer import Trainer
from retrain.types import SamplingParams, TrainBatch
from tests.backend.tiny_model import PROMPTS, encode, make_backend, make_engine, tokenizer_of
from tests.conftest import QUICK, SMALL_BATCH, read_metrics, run_cli, without_timing

SPLIT = ["experiment=quickstart", "eval.num_examples=0", "logging.progress_bar=false", "backend.devices='cpu,cpu'"]


def test_one_device_is_colocated_and_two_split():
    assert not resolve_devices("cpu").split
    plan = resolve_devices("cpu,cpu")
    assert plan.split and plan.inference.type == plan.training.type == "cpu"


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this machine has two GPUs")
def test_split_mode_without_two_gpus_is_a_clear_error():
    with pytest.raises(ConfigError, match=re.escape("split mode needs two GPUs, but")):
        resolve_devices("gpu:0,gpu:1")


@pytest.mark.parametrize(
    ("devices", "message"),
    [("gpu:0,gpu:0", "two different GPUs"), ("cpu,gpu:0", "two different GPUs"), ("cpu,cpu,cpu", "give one device")],
)
def test_bad_split_devices_are_named(devices, message):
    with pytest.raises(ConfigError, match=re.escape(f"backend.devices={devices!r}")) as error:
        resolve_devices(devices)
    assert message in str(error.value)


def test_the_engine_samples_with_its_own_copy_kept_current_by_sync():
    tiny_spec = ModelSpec(name_or_path="retrain:tiny_qwen3", lora_rank=4)
    backend = make_backend(tiny_spec, lr=0.5, devices="cpu,cpu")
    engine = make_engine(backend)
    assert engine.model is not backend.model  # training may change the backend's weights mid-sample
    probe = Probe.from_tokenizer(tokenizer_of(tiny_spec.name_or_path))
    proof = FreshnessProof(probe, backend)
    proof.check(engine, 0)
    rollouts = engine.generate(encode(backend, PROMPTS), 4, SamplingParams(max_tokens=6), 0)
    advantages = torch.randn(rollouts.completion_ids.shape, generator=torch.Generator().manual_seed(0))
    update = backend.train(
        TrainBatch(rollouts, advantages * rollouts.completion_mask, torch.ones(rollouts.num_rows, dtype=torch.bool))
    ).update
    assert update is not None
    assert not torch.allclose(engine.probe_logprobs(probe), backend.probe_logprobs(probe))  # not shared
    engine.sync(update)
    # fp32 rounding only: the engine samples through merged LoRA weights, and lr 0.5 makes the update large
    assert proof.check(engine, update.version).gap < 1e-4


def split_run(tmp_path: Path, name: str, steps: int, *extra: str) -> list[dict]:
    run_dir = tmp_path / name
    run_cli(
        [*SPLIT, "training.save_every=3", f"training.max_steps={steps}", f"hydra.run.dir={run_dir}", *extra],
        cwd=tmp_path,
    )
    return read_metrics(run_dir)


def test_sampling_overlaps_training_with_one_step_of_lag(tmp_path: Path):
    """Lag 1 on every step sampled during the previous step's training; none right after a checkpoint."""
    records = split_run(tmp_path, "run", 6)
    assert [r["engine/policy_lag"] for r in records] == [0, 1, 1, 0, 1, 1]
    assert [r["engine/weight_version"] for r in records] == [0, 0, 1, 3, 3, 4]
    lagged = [r for r in records if r["engine/policy_lag"] == 1]
    assert all(r["engine/logprob_abs_diff"] > 1e-4 for r in lagged)  # one step off-policy, corrected by the ratio
    assert all(r["engine/logprob_abs_diff"] < 1e-5 for r in records if r["engine/policy_lag"] == 0)


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 2])
def test_a_split_run_resumed_from_a_checkpoint_follows_the_uninterrupted_one(tmp_path: Path, k: int):
    """No step is sampled ahead across a checkpoint (training.max_staleness 1, split mode's default, or 2), so a run
    killed after it resumes from it sampling exactly what the uninterrupted one did."""
    ahead = f"training.max_staleness={k}"
    reference = split_run(tmp_path, "full", 6, ahead)
    split_run(tmp_path, "partial", 3, ahead)
    resumed = split_run(tmp_path, "resumed", 6, ahead, f"resume.from={tmp_path / 'partial'}")
    assert max(r["engine/policy_lag"] for r in reference) == k
    assert without_timing(resumed) == without_timing(reference)


def stopped_after(trainer: Trainer, steps: int) -> Trainer:
    """Request a graceful stop (as SIGTERM or Ctrl-C does) once `steps` steps are done."""
    train_step = trainer.train_step

    def step_then_stop(step: int) -> dict:
        record = train_step(step)
        if step + 1 == steps:
            trainer.request_stop()
        return record

    trainer.train_step = step_then_stop  # type: ignore[method-assign]
    return trainer


def split_trained(run_dir: Path, stop_after: int | None = None) -> dict:
    overrides = [*QUICK, *SMALL_BATCH, "backend.devices='cpu,cpu'", "training.save_every=3", "training.max_steps=10"]
    with ExitStack() as parts:
        trainer = build_trainer(compose(overrides), run_dir, parts)
        return (stopped_after(trainer, stop_after) if stop_after else trainer).run()


@pytest.mark.parametrize("stop_after", [7, 8])
def test_a_graceful_stop_off_a_checkpoint_boundary_resumes_exactly(tmp_path: Path, stop_after: int) -> None:
    """Step 8 is sampled ahead while step 7 trains; a stop after step 7 keeps that sample in its checkpoint, so the
    resumed run trains on what the uninterrupted one did (engine/policy_lag and correct_rate included)."""
    assert split_trained(tmp_path / "full")["state"] == "done"
    assert split_trained(tmp_path / "stopped", stop_after)["state"] == "stopped"
    kept = tmp_path / "stopped" / "checkpoints" / f"step_{stop_after}" / SAMPLED_AHEAD_FILE
    assert kept.is_file()
    assert Checkpoint(kept.parent).damage(LocalBackend.checkpoint_files) is None  # reads with weights_only
    assert split_trained(tmp_path / "stopped")["state"] == "done"
    full, resumed = read_metrics(tmp_path / "full"), read_metrics(tmp_path / "stopped")
    assert [r["engine/policy_lag"] for r in resumed] == [0, 1, 1, 0, 1, 1, 0, 1, 1, 0]
    assert without_timing(resumed) == without_timing(full)
