"""`training.max_staleness` k (docs/async.md): the schedule that pins each batch to weights, the producer that
prepares batches ahead on its own thread, which engines may sample ahead, and the correction's default."""

from __future__ import annotations

import threading
import time
from contextlib import ExitStack
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from retrain.config import TrainingConfig, compose
from retrain.distributed.world import World
from retrain.errors import ConfigError
from retrain.inference.openai_server import OpenAIEngine
from retrain.inference.pytorch import PytorchEngine
from retrain.inference.sglang import SglangEngine
from retrain.inference.vllm import VllmEngine
from retrain.inference.vllm_server import VllmServerEngine
from retrain.model.probe import StaleWeightsError
from retrain.run import build_trainer, checked_max_staleness, plan_parts
from retrain.training.dynamic_sampling import ScoredGroups
from retrain.training.producer import PreparedBatch, Producer, Schedule
from retrain.training.staleness import resolve_max_staleness
from retrain.types import Rollouts
from tests.conftest import QUICK


def schedule(k: int, *, first: int = 0, max_steps: int = 12, every: int = 0) -> Schedule:
    return Schedule(k, first, max_steps, lambda step: step == first or (every > 0 and step % every == 0))


def test_each_batch_is_pinned_to_the_weights_k_steps_before_never_across_a_barrier():
    assert [schedule(0).weights_for(t) for t in range(5)] == [0, 1, 2, 3, 4]
    assert [schedule(1).weights_for(t) for t in range(5)] == [0, 0, 1, 2, 3]
    assert [schedule(2).weights_for(t) for t in range(5)] == [0, 0, 0, 1, 2]
    # a checkpoint before steps 0, 4, 8: batches 4.. are sampled with step 4's weights (lag 0, 1, 2, 2, 0 ...)
    assert [schedule(2, every=4).weights_for(t) for t in range(10)] == [0, 0, 0, 1, 4, 4, 4, 5, 8, 8]
    # resumed at step 5: nothing before it exists
    assert [schedule(3, first=5).weights_for(t) for t in range(5, 10)] == [5, 5, 5, 5, 6]


def test_the_weights_of_a_step_serve_until_the_last_batch_pinned_to_them():
    assert [schedule(2).last_on(j) for j in range(4)] == [2, 3, 4, 5]
    assert schedule(2, every=4).last_on(2) == 3  # batch 4 waits for the checkpoint, then step 4's weights
    assert schedule(2, max_steps=6).last_on(5) == 5  # none beyond the last step
    assert schedule(0).last_on(3) == 3


def batch_of(step: int) -> PreparedBatch:
    rollouts = Rollouts(
        prompt_ids=torch.zeros(1, 1, dtype=torch.long),
        prompt_mask=torch.ones(1, 1, dtype=torch.bool),
        completion_ids=torch.zeros(1, 1, dtype=torch.long),
        completion_mask=torch.ones(1, 1, dtype=torch.bool),
        logprobs=torch.zeros(1, 1),
        texts=[""],
        group_size=1,
        hit_max_tokens=torch.zeros(1, dtype=torch.bool),
    )
    groups = ScoredGroups([], rollouts, torch.zeros(1, 1), torch.zeros(1, 1, dtype=torch.bool), {})
    return PreparedBatch(step, groups, {}, 0, {}, {})


class Work:
    """What the producer runs: records which batches it prepared, under which released weights."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.started: list[tuple[int, int]] = []  # (batch, the newest step released when it started)
        self.fail_at = fail_at
        self.released = -1

    def __call__(self, step: int) -> PreparedBatch:
        self.started.append((step, self.released))
        if step == self.fail_at:
            raise OSError(f"server down at batch {step}")
        return batch_of(step)


def test_the_producer_prepares_up_to_k_ahead_as_the_weights_are_released():
    work = Work()
    producer = Producer(work, schedule(2, max_steps=6), [])
    try:
        time.sleep(0.1)
        assert work.started == []  # nothing before the first weights are released
        no_stop = threading.Event()
        for step in range(6):
            work.released = step
            producer.release(step)
            taken, _ = producer.take(step, no_stop)
            assert taken.step == step
            producer.wait_through(producer.schedule.last_on(step), no_stop)
            assert max(started for started, _ in work.started) == min(step + 2, 5)
        # every batch started under the weights it is pinned to: k steps back, the first three under step 0's
        assert work.started == [(0, 0), (1, 0), (2, 0), (3, 1), (4, 2), (5, 3)]
        assert producer.ahead() == []
    finally:
        producer.close()


def test_a_batch_that_failed_raises_in_the_trainer_when_it_needs_it():
    producer = Producer(Work(fail_at=2), schedule(2, max_steps=6), [])
    try:
        producer.release(0)
        no_stop = threading.Event()
        assert producer.take(0, no_stop)[0].step == 0
        with pytest.raises(OSError, match="server down at batch 2"):
            producer.wait_through(2, no_stop)
        assert producer.take(1, no_stop)[0].step == 1  # prepared before the failure
        with pytest.raises(OSError, match="server down at batch 2"):
            producer.take(2, no_stop)
    finally:
        producer.close()


def test_a_stop_while_the_trainer_waits_interrupts_the_batch_in_flight():
    arrived, interrupted = threading.Event(), threading.Event()

    def stuck(step: int) -> PreparedBatch:
        arrived.set()
        if not interrupted.wait(30):
            raise AssertionError("never interrupted")
        raise InterruptedError(f"batch {step} cancelled")

    producer = Producer(stuck, schedule(1), [], interrupt=interrupted.set)
    stop = threading.Event()
    try:
        producer.release(0)
        assert arrived.wait(30)
        stop.set()
        with pytest.raises(InterruptedError, match="batch 0 cancelled"):
            producer.take(0, stop)
    finally:
        producer.close()


def test_a_stop_lets_the_batches_ahead_finish_for_a_while_then_interrupts_them():
    arrived, interrupted = threading.Event(), threading.Event()

    def stalled_at_2(step: int) -> PreparedBatch:
        if step == 2:
            arrived.set()
            if not interrupted.wait(30):
                raise AssertionError("never interrupted")
            raise InterruptedError(f"batch {step} cancelled")
        return batch_of(step)

    producer = Producer(stalled_at_2, schedule(2), [], interrupt=interrupted.set)
    producer.STOP_GRACE_S = 0.5
    stop = threading.Event()
    try:
        producer.release(0)
        assert producer.take(0, stop)[0].step == 0
        assert arrived.wait(30)
        stop.set()
        started = time.perf_counter()
        with pytest.raises(InterruptedError, match="batch 2 cancelled"):
            producer.wait_through(2, stop)
        assert time.perf_counter() - started >= 0.5  # the grace first
        assert [batch.step for batch in producer.ahead()] == [1]  # what the stop's checkpoint keeps
    finally:
        producer.close()


def test_batches_a_checkpoint_kept_are_trained_first():
    work = Work()
    producer = Producer(work, schedule(2, first=3, max_steps=8), [batch_of(3), batch_of(4)])
    try:
        producer.release(3)
        no_stop = threading.Event()
        assert producer.take(3, no_stop)[0].step == 3
        assert producer.take(4, no_stop)[0].step == 4
        producer.wait_through(5, no_stop)
        assert work.started == [(5, -1)]  # the first batch it prepares itself
    finally:
        producer.close()


@pytest.mark.parametrize("engine_cls", [VllmServerEngine, SglangEngine, OpenAIEngine])
def test_server_engines_sample_ahead(engine_cls: type):
    assert resolve_max_staleness(2, devices="cpu", engine_cls=engine_cls, samples_itself=False, ranks=1) == 2
    assert resolve_max_staleness(None, devices="cpu", engine_cls=engine_cls, samples_itself=False, ranks=1) == 0


@pytest.mark.parametrize("engine_cls", [PytorchEngine, VllmEngine])
def test_an_in_process_engine_samples_ahead_only_in_split_mode(engine_cls: type):
    with pytest.raises(ConfigError, match=r"training.max_staleness=1: inference engine .* trainer's device"):
        resolve_max_staleness(1, devices="gpu:0", engine_cls=engine_cls, samples_itself=False, ranks=1)
    assert resolve_max_staleness(3, devices="cpu,cpu", engine_cls=engine_cls, samples_itself=False, ranks=1) == 3
    # split mode has always sampled one step ahead; one device samples on-policy
    assert resolve_max_staleness(None, devices="cpu,cpu", engine_cls=engine_cls, samples_itself=False, ranks=1) == 1
    assert resolve_max_staleness(None, devices="cpu", engine_cls=engine_cls, samples_itself=False, ranks=1) == 0


def test_self_sampling_backends_refuse_to_sample_ahead_and_data_parallel_ranks_on_servers_do_not():
    with pytest.raises(ConfigError, match="training.max_staleness=1: backend .* samples itself"):
        resolve_max_staleness(1, devices="cpu", engine_cls=SglangEngine, samples_itself=True, ranks=1)
    assert resolve_max_staleness(2, devices="gpu:0", engine_cls=SglangEngine, samples_itself=False, ranks=2) == 2
    with pytest.raises(ConfigError, match=r"training.max_staleness=1: inference engine .* trainer's device"):
        resolve_max_staleness(1, devices="gpu:0", engine_cls=PytorchEngine, samples_itself=False, ranks=2)


def test_a_data_parallel_rank_on_a_server_samples_ahead():
    """What the rank's build_trainer checks before any model loads."""
    cfg = compose([*QUICK, "inference=sglang", "training.max_staleness=1"])
    training = OmegaConf.to_object(cfg.training)
    assert checked_max_staleness(cfg, training, plan_parts(cfg), World(rank=1, size=2)) == 1  # type: ignore[arg-type]
    assert checked_max_staleness(cfg, training, plan_parts(cfg), World()) == 1  # type: ignore[arg-type]


def test_a_run_on_one_device_refuses_k_before_any_model_loads(tmp_path: Path):
    with ExitStack() as parts, pytest.raises(ConfigError, match="training.max_staleness=2"):
        build_trainer(compose([*QUICK, "training.max_staleness=2"]), tmp_path, parts)
    assert not (tmp_path / "checkpoints").exists()


def test_a_negative_bound_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match="training.max_staleness must be >= 0"):
        TrainingConfig(max_staleness=-1)


def test_split_mode_samples_one_step_ahead_with_the_correction_on_by_default(tmp_path: Path):
    """Split mode's default k is 1, and sampling ahead resolves a null training.mismatch_mode to tis (the pytorch
    engine samples with the trainer's model, but weights up to k steps older); k=0 in split mode stays uncorrected."""
    split = [*QUICK, "backend.devices='cpu,cpu'"]
    with ExitStack() as parts:
        trainer = build_trainer(compose(split), tmp_path / "ahead", parts)
        assert trainer.max_staleness == 1
        assert trainer.backend.loss_settings.mismatch_mode == "tis"  # type: ignore[attr-defined]
        with pytest.raises(StaleWeightsError, match=r"step 5 .* 2 optimizer steps older .* training.max_staleness=1"):
            trainer._check_staleness(5, 2)  # the bound is asserted on every step
        trainer._check_staleness(5, 1)
    with ExitStack() as parts:
        trainer = build_trainer(compose([*split, "training.max_staleness=0"]), tmp_path / "on_policy", parts)
        assert trainer.max_staleness == 0
        assert trainer.backend.loss_settings.mismatch_mode == "none"  # type: ignore[attr-defined]
