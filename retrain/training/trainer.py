"""The step loop: sample -> score -> advantages -> train -> sync -> log -> checkpoint; nothing model-specific.

The trainer talks to its parts only through their small interfaces (retrain.backend.base.Backend,
retrain.inference.base.InferenceEngine, retrain.algorithm.base.Algorithm, DataSource, Scorer,
Batching), so any of them can be swapped by config without touching this file. It holds the
training backend and the inference engine as two parts: the backend's WeightUpdate goes to the
engine in the step, and the freshness probe proves the engine serves it before the next step samples. With
`training.max_staleness` k > 0 a producer thread (retrain.training.producer) samples and scores up to k steps ahead
while this one trains (docs/async.md).
"""

from __future__ import annotations

import base64
import functools
import logging
import math
import os
import random
import socket
import sys
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from torch.distributed import ProcessGroup
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from retrain.algorithm.base import Algorithm
from retrain.backend.base import Backend
from retrain.backend.capabilities import capabilities_of
from retrain.config import EvalConfig, LoggingConfig, TrainingConfig
from retrain.data.base import DataSource
from retrain.distributed.step import StepShare
from retrain.distributed.world import World, collectives_on, from_main, thread_group
from retrain.environments.base import RolloutEnvironment, ScoredRollouts
from retrain.errors import UserError
from retrain.housekeeping.console import progress_bar_shown
from retrain.housekeeping.rundir import Checkpoint, RunDir
from retrain.housekeeping.trainer_state import TrainerState
from retrain.inference.base import InferenceEngine, SamplingInterrupted, ServesVersions
from retrain.model.probe import Probe, StaleWeightsError
from retrain.reward.overlong import overlong_buffer, shape_rewards
from retrain.reward.scorer import Scorer, fill_excluded
from retrain.training.batching import Batching
from retrain.training.dynamic_sampling import ScoredGroups, collect
from retrain.training.freshness import Freshness, FreshnessProof
from retrain.training.learning_curve import LEARNING_CURVE_PNG, write_learning_curve
from retrain.training.metrics_log import JsonlLog, TensorBoardSink, WandbSink, console_line
from retrain.training.producer import PreparedBatch, Producer, Schedule
from retrain.training.sampled_ahead import load_sampled_ahead, save_sampled_ahead
from retrain.training.staleness import KEY as MAX_STALENESS
from retrain.types import Example, Rollouts, SamplingParams, TrainBatch, TrainResult, WeightUpdate

log = logging.getLogger("retrain")

CORRECT_THRESHOLD = 0.5  # a completion is correct when its reward is > 0.5 (docs/advantages.md)

PromptEncoder = Callable[[list[str]], list[list[int]]]  # user messages -> chat-templated prompt ids
PlanningDetection = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (ids, mask) [N, T] -> planning mask


def step_generator_seed(seed: int, step: int) -> int:
    """Sampling seed of a step: a resumed run samples exactly what an uninterrupted one would."""
    return (seed * 1_000_003 + step) % (2**63)


class Trainer:
    """Runs the RLVR loop over its parts; the composition root (retrain/run.py) builds and closes them.

    `training.seed` is the resolved seed (never -1). `planning` is set only when the algorithm needs
    planning tokens; `eval_examples` are the held-out problems (none: no evaluation). `run_config`
    is the config as it may be shown (retrain.housekeeping.secrets: no environment value, no secret), recorded by
    wandb; `config_identity` is saved in every checkpoint. `world`: this process's rank in a data-parallel run
    (docs/distributed.md): it samples, scores and trains its share of each step's groups, and only rank 0 writes
    the run dir; `pad_id` pads the ranks' gathered token ids as the engine pads them. `training.max_staleness` is
    resolved (retrain.training.staleness): an int, 0 when the engine cannot sample ahead.
    """

    def __init__(
        self,
        *,
        backend: Backend,
        engine: InferenceEngine,
        algorithm: Algorithm,
        planning: PlanningDetection | None,
        data: DataSource,
        eval_examples: list[Example],
        scorer: Scorer,
        prompts: PromptEncoder,
        probe: Probe,
        batching: Batching,
        training: TrainingConfig,
        evaluation: EvalConfig,
        output: LoggingConfig,
        run_dir: Path,
        resume_checkpoint: Path | None = None,
        run_config: dict[str, Any] | None = None,
        config_identity: dict[str, Any] | None = None,
        world: World | None = None,
        pad_id: int = 0,
    ) -> None:
        self.backend = backend
        self.engine = engine
        self.capabilities = capabilities_of(backend)
        self.algorithm = algorithm
        self.planning = planning
        self.data = data
        self.eval_examples = eval_examples
        self.scorer = scorer
        self.prompts = prompts
        self.freshness = FreshnessProof(probe, backend)
        self.weights_version = 0  # the newest optimizer step's weights (what the engine must serve)
        self.batching = batching
        self.training = training
        self.evaluation = evaluation
        self.output = output
        self.sampling = SamplingParams.from_config(training, return_entropies=algorithm.needs_entropies)
        self.run_dir = run_dir
        self.resume_checkpoint = resume_checkpoint
        self.run_config = run_config or {}
        self.config_identity = config_identity or {}
        self.world = world or World()
        self.share = StepShare(self.world, pad_id)
        self.wandb: WandbSink | None = None
        self.tensorboard: TensorBoardSink | None = None
        self.wandb_run_id: str | None = None
        self.files = RunDir(run_dir)
        self.metrics = JsonlLog(self.files.metrics)
        self.steps_log = JsonlLog(self.files.emergence_steps)
        self.generations_log = JsonlLog(self.files.emergence_generations)
        self.next_step = 0
        self.total_correct = 0
        self.total_completions = 0
        self.eval_results: dict[str, float] = {}
        self._stop = threading.Event()
        if training.max_staleness is None:
            raise ValueError(f"{MAX_STALENESS} must be resolved before the trainer is built (retrain.run)")
        self.max_staleness = training.max_staleness
        self._producer: Producer | None = None  # k > 0: prepares the next steps' batches while this thread trains
        self._resumed_ahead: list[PreparedBatch] = []  # the batches a graceful stop's checkpoint kept
        # an engine that serves several weights versions at once (server engines' adapters): each batch names the
        # version it is pinned to, and newer weights load without waiting for the batches ahead (docs/async.md)
        self._pinning: ServesVersions | None = None
        self._version_at: dict[int, int] = {}  # step -> the weights version the engine served when it began
        self._last_saved_step = -1
        self.skipped_in_a_row = 0  # optimizer steps skipped for a non-finite loss or grad norm (this process)

    # ---- control -------------------------------------------------------------------------
    def request_stop(self) -> None:
        """Ask the loop to checkpoint after the current step and return (signal- and thread-safe). An engine
        that can cancel sampling in flight (`interrupt`) does: the step waiting on it is dropped, and the run
        checkpoints the steps it finished, instead of waiting out a stuck request. Sampling ahead (k > 0), the
        engine is interrupted only while the trainer waits for its step's batch (Producer.take), or once the
        batches ahead had Producer.STOP_GRACE_S to finish (Producer.wait_through): the stop's checkpoint keeps them. Data-parallel, no engine is interrupted: the
        signalled rank alone would drop its step while the others wait for its share in the step's gather; the
        ranks stop together after the step (`_stop_agreed`)."""
        self._stop.set()
        interrupt = getattr(self.engine, "interrupt", None)
        if callable(interrupt) and not self.world.distributed and self.max_staleness == 0:
            interrupt()

    # ---- the loop ------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Train to max_steps (or until a stop request); returns the final status."""
        try:
            if self.resume_checkpoint is None:
                self._start_over()
                self.freshness.check(self.engine, self.weights_version)  # the engine starts on the initial adapter
            elif self._restore(self.resume_checkpoint):
                return self._write_status("done")
            self._start_wandb()
            if self.output.tensorboard and self.world.is_main:
                self.tensorboard = TensorBoardSink(self.run_dir, self.next_step)
            if self.next_step == 0 and self.eval_examples:
                self._evaluate("before")
            self._write_status("running")
            if self.max_staleness > 0:
                self._producer = self._start_producer()
            try:
                self._loop()
                if self._stop.is_set() and self.next_step < self.training.max_steps:
                    return self._write_status("stopped")
                if self.eval_examples:
                    self._evaluate("after")
            except SamplingInterrupted:
                if not self._stop.is_set():
                    raise
                return self._stopped_while_sampling()
            self.save(final=True)
            return self._write_status("done")
        except BaseException as error:
            self._write_status("failed", error=f"{type(error).__name__}: {error}")
            raise
        finally:
            if self._producer is not None:
                self._producer.close()
            if self.wandb is not None:
                self.wandb.finish()
            if self.tensorboard is not None:
                self.tensorboard.close()

    def _stopped_while_sampling(self) -> dict[str, Any]:
        """A stop request cancelled sampling in flight: the unfinished step is dropped (its prompts go back
        to the data source) and the steps done are checkpointed, as after a step."""
        log.warning(
            "Stopped while sampling: step %d is dropped; the checkpoint holds the steps before it", self.next_step
        )
        if self.next_step > 0 and self._last_saved_step != self.next_step - 1:
            self.save()
        return self._write_status("stopped")

    def _loop(self) -> None:
        training = self.training
        with (
            logging_redirect_tqdm(loggers=[logging.root]),
            tqdm(
                total=training.max_steps,
                initial=self.next_step,
                desc=self.algorithm.name,
                file=sys.stdout,  # beside the step lines, which logging_redirect_tqdm writes above it
                disable=not progress_bar_shown(self.output.progress_bar, sys.stdout),
                dynamic_ncols=True,
                mininterval=0,  # one redraw a step, however fast: tqdm's 0.1 s default skipped a fast run's last step
                miniters=1,
                leave=False,
            ) as bar,
        ):
            while self.next_step < training.max_steps:
                step = self.next_step
                # measured with the weights this step samples with: its record, at `step` steps trained, holds it
                held_out = self._evaluate(f"{step} steps") if self._evaluates_before(step) else {}
                record = {**self.train_step(step), **held_out}
                self.next_step = step + 1
                self._log_step(record)
                bar.update(1)
                if training.save_every > 0 and self.next_step % training.save_every == 0:
                    self.save()
                if self._stop_agreed():
                    if self._producer is not None:  # the stop's checkpoint keeps the batches pinned to these weights
                        self._wait_for_batches_ahead(step)
                    if self._last_saved_step != step:
                        self.save()
                    return

    def _stop_agreed(self) -> bool:
        """Whether to stop after this step: asked for here, or, data-parallel, on any rank. Every rank acts on the
        agreed answer, never on its own flag: a signal that lands during the all-reduce sets this rank's flag after
        it voted, and a rank that stopped on it alone would pair its next collectives with the others' next step's
        (it stops after the next step, with the others)."""
        agreed = self.share.any_rank(self._stop.is_set())
        if agreed:
            self._stop.set()
        return agreed

    def train_step(self, step: int) -> dict[str, Any]:
        """One RLVR step; returns its metrics record."""
        training = self.training
        G = training.group_size
        started = time.perf_counter()
        step_metrics = self.algorithm.begin_step(step)

        prepared, asynchronous = self._batch(step)
        groups, served_version = prepared.groups, prepared.served_version
        B = len(groups.examples)
        # excluded: no verdict, neither trained on nor counted
        examples, rollouts, rewards, excluded = groups.examples, groups.rollouts, groups.rewards, groups.excluded
        shaped, shaping_metrics = self._shaped(groups)

        t_advantage = time.perf_counter()
        planning = None
        if self.planning is not None:
            planning = self.planning(rollouts.completion_ids, rollouts.trained_mask)
        advantage = self.algorithm.compute(
            shaped, rollouts.logprobs, rollouts.trained_mask, rollouts.entropies, planning
        )
        row_mask = advantage.group_has_signal.repeat_interleave(G) & ~excluded.view(-1)
        if training.mask_truncated:  # overlong filtering: a truncated completion carries no gradient
            shaping_metrics["policy/truncated_masked"] = int((row_mask & rollouts.hit_max_tokens).sum())
            row_mask &= ~rollouts.hit_max_tokens
        batch = TrainBatch(rollouts=rollouts, advantages=advantage.token_advantages, row_mask=row_mask)

        t_train = time.perf_counter()
        policy_lag = self.weights_version - served_version  # optimizer steps between sampling and training weights
        self._check_staleness(step, policy_lag)
        result = self.backend.train(self.share.own_rows(batch)) if batch.num_datums else _no_update()
        self._check_sampling_route(result.metrics.get("engine/logprob_abs_diff"), policy_lag, served_version)
        self._count_skipped(result)
        t_wait = time.perf_counter()
        if self._pinning is not None:  # the batches ahead keep their versions loaded while this one loads
            if result.update is not None:
                self._pinning.keep_versions_from(self._oldest_pinned_after(step, result.update.version))
        elif self._producer is not None:  # the engine serves one version: the batches pinned to this one finish first
            self._wait_for_batches_ahead(step)
        t_sync = time.perf_counter()
        freshness = {} if result.update is None else self._sync_engine(result.update).metrics()
        if result.update is not None and result.update.tensors is not None:
            self.share.check_same_weights(result.update.tensors, step)
        t_end = time.perf_counter()

        correct = (rewards > CORRECT_THRESHOLD) & ~excluded
        judged = int((~excluded).sum())
        correct_rate = float(correct.sum()) / max(judged, 1)
        self.total_correct += int(correct.sum())
        self.total_completions += judged
        self.algorithm.end_step(correct_rate)
        uniform = ~advantage.group_has_signal
        all_correct = (correct | excluded).all(dim=1)
        timings = {
            "sample_time_s": prepared.sample_time_s,
            "reward_time_s": prepared.reward_time_s,  # dynamic sampling's refill rounds included
            "advantage_time_s": t_train - t_advantage,
            "train_time_s": t_wait - t_train,
            "overlap_wait_s": t_sync - t_wait,  # sampling ahead: waiting for the batches pinned to these weights
            "sync_time_s": t_end - t_sync,  # weight sync to the engine and its freshness proof
        }
        # this thread's share of the step: the batch's sampling and scoring, or (sampled ahead) its wait for them
        waited = dict(asynchronous) or {
            "sample_time_s": timings["sample_time_s"],
            "reward_time_s": timings["reward_time_s"],
        }
        own_time = sum(waited.values()) + t_end - t_advantage
        record: dict[str, Any] = {
            "step": step,
            "condition": self.algorithm.name,
            "seed": training.seed,
            "loss": result.loss,
            "mean_reward": float(rewards.mean()),
            "correct_rate": correct_rate,
            "running_correct_rate": self.total_correct / max(self.total_completions, 1),
            "num_datums": batch.num_datums,
            "num_tokens": result.num_tokens,
            "max_token_hit_rate": float(rollouts.hit_max_tokens.float().mean()),
            "mean_completion_tokens": float(rollouts.completion_mask.sum(dim=1).float().mean()),
            "batch_size": B,
            "group_size": G,
            **step_metrics,
            "groups_skipped": int(uniform.sum()),
            "groups_all_correct": int((uniform & all_correct).sum()),
            "groups_all_wrong": int((uniform & ~all_correct).sum()),
            "grad_norm": result.grad_norm,
            "skipped_nonfinite": result.skipped_nonfinite,
            **groups.counts,
            **prepared.dapo_metrics,
            **shaping_metrics,
            **advantage.metrics,
            **rollouts.metrics,  # the sampler's, e.g. policy/top_p_mass: every step, trained on or not
            **result.metrics,
            "engine/weight_version": served_version,
            "engine/policy_lag": policy_lag,
            **freshness,
            **timings,
            **asynchronous,
            "other_time_s": (t_end - started) - own_time,
            "step_time_s": t_end - started,
            **self.share.metrics(timings["sample_time_s"]),
        }
        self._log_samples(step, examples, rollouts, rewards, correct, planning)
        # e.g. train/backpressure/... when the size adapts; ranks observe rank 0's record, so they adapt alike
        record.update(self.batching.observe(from_main(record)))
        return record

    def _batch(self, step: int) -> tuple[PreparedBatch, dict[str, float]]:
        """Step `step`'s batch, prepared on this thread (max_staleness 0) or taken from the producer, with the times
        each side waited for the other (`async/...`, sampling ahead only)."""
        if self._producer is None:
            return self._prepare(step), {}
        self._version_at[step] = self.weights_version
        self._producer.release(step)  # the engine serves this step's weights since the last step's sync
        prepared, waited = self._producer.take(step, self._stop)
        return prepared, {"async/trainer_wait_s": waited, "async/producer_wait_s": prepared.producer_wait_s}

    def _prepare(self, step: int) -> PreparedBatch:
        """Draw step `step`'s prompts, sample and score them, dynamic sampling's refill rounds included: the same
        work, in the same order of the data stream, on this thread or on the producer's."""
        G = self.training.group_size
        data_before = self.data.state_dict()
        examples = self.data.next_batch(self.batching.batch_size(step))
        B = len(examples)
        pinned = self._pinned_version(step)
        served_version = self.engine.weights_version if pinned is None else pinned
        t_sample = time.perf_counter()
        try:
            with nullcontext() if self._pinning is None or pinned is None else self._pinning.sampling_version(pinned):
                sampled = self._sample(examples, G, self.sampling, step_generator_seed(self.training.seed, step))()
                t_reward = time.perf_counter()
                # dynamic sampling: uniform groups dropped, more prompts drawn and sampled in their place
                groups, dapo_metrics = collect(
                    self._scored(sampled, examples, G),
                    functools.partial(self._refill, step, B),
                    lambda scored: self._shaped(scored)[0],
                    self.training.dynamic_sampling,
                    B,
                    self.share.pad_id,
                )
        except BaseException:  # interrupted by a stop, or failed: the prompts are drawn again when the run resumes
            self.data.load_state_dict(data_before)
            raise
        return PreparedBatch(
            step=step,
            groups=groups,
            dapo_metrics=dapo_metrics,
            served_version=served_version,
            data_before=data_before,
            data_after=self.data.state_dict(),
            sample_time_s=t_reward - t_sample,
            reward_time_s=time.perf_counter() - t_reward,
        )

    def _wait_for_batches_ahead(self, step: int) -> None:
        """Before newer weights load, the batches pinned to step `step`'s or older weights finish. A stop that had to
        interrupt them (a stalled server, Producer.STOP_GRACE_S) or found one of them failed (a dead server) loses
        only those: this step is trained and counts, and the stop's checkpoint keeps the batches finished before
        them (the rest are sampled again on resume, where a lasting fault fails the run)."""
        assert self._producer is not None
        try:
            self._producer.wait_through(self._producer.schedule.last_on(step), self._stop)
        except SamplingInterrupted:
            if not self._stop.is_set():
                raise
            log.warning(
                "Stopped while sampling ahead: the batches after step %d not finished are sampled again on resume",
                step,
            )
        except Exception as error:
            if not self._stop.is_set():
                raise
            log.warning(
                "Stopping: a batch sampled ahead failed (%s: %s); the checkpoint keeps the batches after step %d "
                "before it, the rest are sampled again on resume",
                type(error).__name__,
                error,
                step,
            )

    def _pinned_version(self, step: int) -> int | None:
        """The weights version batch `step` names on an engine serving several (None: the engine's only one)."""
        if self._pinning is None:
            return None
        assert self._producer is not None
        return self._version_at[self._producer.schedule.weights_for(step)]

    def _oldest_pinned_after(self, step: int, newest: int) -> int:
        """The oldest weights version a batch after step `step` is pinned to (`newest`, the version this step's sync
        loads, when none is pinned to an older one): older versions can be unloaded."""
        assert self._producer is not None
        schedule = self._producer.schedule
        pinned_to = schedule.weights_for(step + 1) if step + 1 < schedule.max_steps else step + 1
        for done in [s for s in self._version_at if s < min(pinned_to, step)]:
            del self._version_at[done]  # no batch is pinned to it any more
        return self._version_at[pinned_to] if pinned_to <= step else newest

    def _start_producer(self) -> Producer:
        """The producer of this process's steps, holding the batches a graceful stop's checkpoint kept."""
        engine = self.engine
        self._pinning = engine if isinstance(engine, ServesVersions) and engine.serves_versions else None
        first = self.next_step
        schedule = Schedule(
            max_staleness=self.max_staleness,
            first=first,
            max_steps=self.training.max_steps,
            barrier=lambda step: step == first or self._saves_before(step) or self._evaluates_before(step),
        )
        ready, self._resumed_ahead = self._resumed_ahead, []
        if self.world.distributed:  # its gathers on a group of their own; no rank interrupts its share alone
            return Producer(functools.partial(self._prepare_on, thread_group()), schedule, ready, None)
        interrupt = getattr(self.engine, "interrupt", None)
        return Producer(self._prepare, schedule, ready, interrupt if callable(interrupt) else None)

    def _prepare_on(self, group: ProcessGroup | None, step: int) -> PreparedBatch:
        """`_prepare` with its collectives (the ranks' gathers) on `group`: the producer's, so that they never pair
        with the trainer's all-reduces, which this rank's other thread issues meanwhile."""
        with collectives_on(group):
            return self._prepare(step)

    def _check_staleness(self, step: int, policy_lag: int) -> None:
        """The bound the schedule keeps: a batch sampled with weights more than k optimizer steps older than the
        trainer's is never trained on."""
        if policy_lag > self.max_staleness:
            raise StaleWeightsError(
                f"step {step} was sampled with weights {policy_lag} optimizer steps older than the trainer's "
                f"(engine/policy_lag), beyond {MAX_STALENESS}={self.max_staleness}"
            )

    def _refill(self, step: int, batch_size: int, draw: int) -> ScoredGroups:
        """Dynamic sampling's extra round `draw` of step `step`: the data stream's next prompts, sampled with the
        step's seed as rows numbered after the earlier rounds' (no two rounds draw the same random numbers)."""
        examples = self.data.next_batch(batch_size)
        seed = step_generator_seed(self.training.seed, step)
        G = self.training.group_size
        sampled = self._sample(examples, G, self.sampling, seed, row_offset=draw * batch_size * G)()
        return self._scored(sampled, examples, G)

    def _scored(self, sampled: Rollouts | ScoredRollouts, examples: list[Example], group_size: int) -> ScoredGroups:
        rollouts, rewards, excluded, counts = self._rewards(sampled, examples, group_size)
        return ScoredGroups(examples, rollouts, rewards, excluded, counts)

    def _shaped(self, groups: ScoredGroups) -> tuple[torch.Tensor, dict[str, float]]:
        """The rewards the advantages see (DAPO's overlong shaping, when on) and its metric."""
        training = self.training
        lengths = groups.rollouts.completion_mask.sum(dim=1)
        return shape_rewards(
            groups.rewards,
            lengths,
            groups.excluded,
            training.max_tokens,
            overlong_buffer(training.max_tokens, training.overlong_buffer_frac),
            training.overlong_penalty,
        )

    def _sample(
        self, examples: list[Example], group_size: int, sampling: SamplingParams, seed: int, row_offset: int = 0
    ) -> Callable[[], Rollouts | ScoredRollouts]:
        """The sampling work for `examples` (prompts encoded here, on the caller's thread): the environment's
        scored episodes when the data source runs its own (retrain.environments), else the engine's completions.
        `row_offset`: the global index of the first row (dynamic sampling's refill rounds; run.py checks the
        engine takes it and the data source is no environment)."""
        if isinstance(self.data, RolloutEnvironment):
            return functools.partial(self.data.sample, examples, group_size, sampling, seed)
        if not self.world.distributed:
            prompt_ids = self.prompts([example.prompt for example in examples])
            if row_offset:
                return functools.partial(
                    self.engine.generate,  # type: ignore[call-arg]
                    prompt_ids,
                    group_size,
                    sampling,
                    seed,
                    row_offset=row_offset,
                )
            return functools.partial(self.engine.generate, prompt_ids, group_size, sampling, seed)
        own, row_offset = self.share.examples(examples, group_size)  # this rank's groups, with their global row ids
        return functools.partial(
            self.engine.generate,  # type: ignore[call-arg]  # run.py checks the engine takes row_offset
            self.prompts([example.prompt for example in own]),
            group_size,
            sampling,
            seed,
            row_offset=row_offset,
        )

    def _rewards(
        self, sampled: Rollouts | ScoredRollouts, examples: list[Example], group_size: int
    ) -> tuple[Rollouts, torch.Tensor, torch.Tensor, dict[str, int]]:
        """(rollouts, rewards [B, G] with excluded rows filled, excluded [B, G], reward/* counts): the
        environment's rubric when it scored its own episodes, else the reward scorer's. Data-parallel: `sampled` is
        this rank's share of `examples`, scored here; what is returned is the whole batch, gathered from every rank."""
        examples = self.share.examples(examples, group_size)[0]
        if isinstance(sampled, ScoredRollouts):
            rollouts, raw, excluded = sampled.rollouts, sampled.rewards, sampled.excluded
            errors, timeouts = sampled.errors, sampled.timeouts
            if sampled.answers is not None:  # the environment leaves scoring its rows' answers to `reward=`
                answered = self.scorer.score(sampled.answers, [e for e in examples for _ in range(group_size)])
                raw = answered.rewards.view(-1, group_size)
                excluded = excluded | answered.excluded_mask().view(-1, group_size)
                errors, timeouts = errors + answered.errors, timeouts + answered.timeouts
        else:
            scored = self.scorer.score(sampled.texts, [example for example in examples for _ in range(group_size)])
            rollouts, raw, excluded = (
                sampled,
                scored.rewards.view(-1, group_size),
                scored.excluded_mask().view(-1, group_size),
            )
            errors, timeouts = scored.errors, scored.timeouts
        counts = {"reward/errors": errors, "reward/timeouts": timeouts, "reward/excluded": int(excluded.sum())}
        return self.share.gathered(rollouts, fill_excluded(raw, excluded), excluded, counts)

    def _saves_before(self, step: int) -> bool:
        """Whether a periodic checkpoint is written before step `step` (nothing is sampled ahead across it, so a run
        resumed from it samples what the uninterrupted run did)."""
        every = self.training.save_every
        return every > 0 and step % every == 0

    def _evaluates_before(self, step: int) -> bool:
        """Whether held-out accuracy is measured before step `step`, after `step` steps trained (eval.every; the
        run's first and last measurements are "before" and "after")."""
        every = self.evaluation.every
        return bool(self.eval_examples) and every > 0 and 0 < step < self.training.max_steps and step % every == 0

    def _check_sampling_route(self, logprob_diff: float | None, policy_lag: int, version: int) -> None:
        """The freshness proof's second check, on the sampling route itself: rollouts sampled with the weights
        the trainer holds (policy lag 0) must carry the trainer's log-probs, within a tolerance by dtype (the
        probe's) widened by what top-p's renormalised nucleus may add (-log top_p). An engine that scores the
        probe with new weights but samples with old ones passes the probe and fails here."""
        if logprob_diff is None or policy_lag != 0:
            return  # nothing trained, or sampled a version behind (split mode): the weights differ by design
        tolerance = self.training.logprob_diff_tolerance
        if tolerance is None:
            tolerance = max(self.backend.probe_tolerance, getattr(self.engine, "probe_tolerance", 0.0))
        allowed = tolerance - (math.log(self.sampling.top_p) if 0 < self.sampling.top_p < 1 else 0.0)
        if not logprob_diff <= allowed:
            raise StaleWeightsError(
                f"the inference engine samples with other weights than the trainer's: its log-probs of the tokens "
                f"it sampled with weights version {version} differ from the trainer's by {logprob_diff:.3g} on "
                f"average (engine/logprob_abs_diff; allowed {allowed:.3g}, training.logprob_diff_tolerance)"
            )

    def _count_skipped(self, result: TrainResult) -> None:
        """A run whose optimizer steps keep being skipped trains nothing: stop it after
        training.max_skipped_steps in a row instead of ending `done` with an untrained adapter."""
        if result.skipped_nonfinite:
            self.skipped_in_a_row += 1
        elif result.update is not None:  # a step with nothing to train on neither counts nor resets
            self.skipped_in_a_row = 0
        limit = self.training.max_skipped_steps
        if limit and self.skipped_in_a_row >= limit:
            raise UserError(
                f"{self.skipped_in_a_row} optimizer steps in a row were skipped for a non-finite loss or grad norm "
                f"(last loss {result.loss}, grad norm {result.grad_norm}; training.max_skipped_steps={limit}): "
                "the adapter is not training; look for non-finite log-probs from the engine or a too-high training.lr"
            )

    def _sync_engine(self, update: WeightUpdate) -> Freshness:
        """Hand the new weights to the engine, then prove it serves them (StaleWeightsError if not)."""
        self.weights_version = update.version
        self.engine.sync(update)
        return self.freshness.check(self.engine, update.version)

    # ---- logging -------------------------------------------------------------------------
    def _log_step(self, record: dict[str, Any]) -> None:
        if not self.world.is_main:
            return
        self.metrics.append(record)
        if self.wandb is not None:
            self.wandb.log(record, step=record["step"])
        if self.tensorboard is not None:
            self.tensorboard.log(record, step=record["step"])
        log.info(console_line(record, self.algorithm.label, not self.capabilities.reports_sync_loss))
        self._write_status("running")

    def _log_samples(
        self,
        step: int,
        examples: list[Example],
        rollouts: Rollouts,
        rewards: torch.Tensor,
        correct: torch.Tensor,
        planning: torch.Tensor | None,
    ) -> None:
        if not self.world.is_main:
            return
        G = self.training.group_size
        for b in range(min(self.output.console_groups, len(examples))):
            log.info("  group: %d/%d correct | answer=%s", int(correct[b].sum()), G, examples[b].reference)
        for n in range(min(self.output.generations_per_step, rollouts.num_rows)):
            example = examples[n // G]
            self.generations_log.append(
                {
                    "step": step,
                    "example_id": example.id,
                    "prompt": example.prompt,
                    "reference": example.reference,
                    "completion": rollouts.texts[n],
                    "reward": float(rewards.view(-1)[n]),
                    "hit_max_tokens": bool(rollouts.hit_max_tokens[n]),
                }
            )
        tokens = rollouts.completion_mask.sum()
        self.steps_log.append(
            {
                "step": step,
                "condition": self.algorithm.name,
                "correct_rate": float(correct.float().mean()),
                "mean_completion_tokens": float(tokens) / rollouts.num_rows,
                "planning_token_fraction": None
                if planning is None
                else float((planning & rollouts.completion_mask).sum()) / max(float(tokens), 1.0),
            }
        )

    def _write_status(self, state: str, error: str | None = None) -> dict[str, Any]:
        status = {
            "state": state,
            "step": self.next_step - 1,
            "max_steps": self.training.max_steps,
            "condition": self.algorithm.name,
            "seed": self.training.seed,
            "updated_at": time.time(),
            "pid": os.getpid(),
            "hostname": socket.gethostname(),
            "error": error,
            "eval": self.eval_results,
        }
        if self.world.is_main:
            self.files.write_status(status)
        return status

    def _start_wandb(self) -> None:
        output = self.output
        if not output.wandb_project or not self.world.is_main:
            return
        self.wandb = WandbSink(
            project=output.wandb_project,
            entity=output.wandb_entity,
            group=output.wandb_group,
            name=output.wandb_run_name or f"{self.algorithm.name}_s{self.training.seed}",
            tags=list(output.wandb_tags),
            config=self.run_config,
            run_dir=self.run_dir,
            run_id=self.wandb_run_id,
        )
        self.wandb_run_id = self.wandb.run_id

    # ---- evaluation ----------------------------------------------------------------------
    def _evaluate(self, when: str) -> dict[str, float]:
        """Held-out accuracy, greedy and sampled, with a fixed sampling seed so the measurements pair up.

        "before" and "after" training go into the run's status and wandb's summary; one after a step
        (`eval.every`, `when` = "N steps") goes into the metrics record of step N, as returned here.
        """
        examples = self.eval_examples
        greedy = SamplingParams(max_tokens=self.sampling.max_tokens, temperature=0.0, top_p=1.0)
        accuracy = {
            "greedy_accuracy": self._accuracy(examples, greedy, 1),
            "sampled_accuracy": self._accuracy(examples, self.sampling, self.evaluation.samples),
        }
        log.info(
            "Held-out accuracy %s (%d problems): greedy=%.1f%% sampled=%.1f%%",
            f"{when} training" if when in ("before", "after") else f"after {when}",
            len(examples),
            100 * accuracy["greedy_accuracy"],
            100 * accuracy["sampled_accuracy"],
        )
        if when not in ("before", "after"):
            return {f"eval/{name}": value for name, value in accuracy.items()}
        results = {f"eval/{when}_{name}": value for name, value in accuracy.items()}
        self.eval_results.update(results)
        if self.wandb is not None:
            self.wandb.summary(results)
        if self.tensorboard is not None:  # no summary there: plotted where they were measured
            self.tensorboard.log(results, step=0 if when == "before" else self.training.max_steps)
        return results

    def _accuracy(self, examples: list[Example], sampling: SamplingParams, samples: int) -> float:
        """Share of correct completions; prompts go in chunks of the configured batch size."""
        correct = total = 0
        chunk = self.training.batch_size
        for start in range(0, len(examples), chunk):
            part = examples[start : start + chunk]
            sampled = self._sample(part, samples, sampling, step_generator_seed(self.training.seed, -1 - start))()
            _, rewards, excluded, _ = self._rewards(sampled, part, samples)
            judged = ~excluded  # completions the reward gave no verdict for do not count
            correct += int(((rewards > CORRECT_THRESHOLD) & judged).sum())
            total += int(judged.sum())
        return correct / max(total, 1)

    # ---- checkpoints ---------------------------------------------------------------------
    def save(self, final: bool = False) -> Path:
        """Checkpoint everything a resumed run needs to continue the same trajectory (rank 0 alone writes it: the
        ranks' adapters and optimizer states are identical)."""
        completed = self.next_step
        if not self.world.is_main:
            self._last_saved_step = completed - 1
            return self.files.final_dir if final else self.files.checkpoint_dir(completed)
        # sampling ahead: the batches pinned to weights older than the next step's (a graceful stop; at a periodic
        # checkpoint there are none); the data state is from before them, each batch holds its own after
        ahead = self._producer.ahead() if self._producer is not None else []
        state = TrainerState(
            step=completed - 1,
            completed_steps=completed,
            max_steps=self.training.max_steps,
            finished=final,
            seed=self.training.seed,
            condition=self.algorithm.name,
            data=ahead[0].data_before if ahead else self.data.state_dict(),
            algorithm=self.algorithm.state_dict(),
            batching=self.batching.state_dict(),
            total_correct=self.total_correct,
            total_completions=self.total_completions,
            group_size=self.training.group_size,
            eval=self.eval_results,
            wandb_run_id=self.wandb_run_id,
            rng=_rng_state(),
            config_identity=self.config_identity,
        )
        checkpoint = self.files.save_checkpoint(
            completed, functools.partial(self._write_checkpoint_files, ahead), state.to_json(), final=final
        )
        self._last_saved_step = completed - 1
        self.files.prune_checkpoints(self.training.keep_checkpoints)
        self._draw_learning_curve()
        return checkpoint.path

    def _write_checkpoint_files(self, ahead: list[PreparedBatch], path: Path) -> None:
        """The backend's files, and the batches sampled ahead that a graceful stop left (retrain.training.sampled_ahead)."""
        self.backend.save(path)
        save_sampled_ahead(ahead, self.max_staleness, path)

    def _draw_learning_curve(self) -> None:
        """learning_curve.png beside metrics.jsonl, redrawn at every checkpoint; a plot that fails costs a warning,
        never the run."""
        try:
            write_learning_curve(
                self.run_dir / LEARNING_CURVE_PNG,
                self.metrics.records(),
                self.eval_results,
                self.training.max_steps,
                f"{self.algorithm.label}, seed {self.training.seed}: {self.run_dir.name}",
            )
        except Exception as error:  # matplotlib's many errors (a font, a full disk): the run's files matter more
            log.warning("could not draw %s: %s: %s", LEARNING_CURVE_PNG, type(error).__name__, error)

    def _start_over(self) -> None:
        """No checkpoint to resume from: drop what an attempt killed before its first checkpoint logged, so a
        restart never writes a step twice (a run dir holding another config's run is refused: retrain/housekeeping/launch.py)."""
        if not self.world.is_main:
            return
        dropped = [log_file.clear() for log_file in (self.metrics, self.steps_log, self.generations_log)]
        if any(dropped):
            log.info("No checkpoint in %s: starting at step 0, dropping what an earlier attempt logged", self.run_dir)

    def _restore(self, checkpoint: Path) -> bool:
        """Load a checkpoint; returns True when it is a finished run (nothing left to do).

        A step checkpoint of the last step is restored like any other: the run was killed before its final/
        (held-out evaluation and the final checkpoint still to do)."""
        state = TrainerState.from_json(Checkpoint(checkpoint).state())
        if state.completed_steps >= self.training.max_steps and Checkpoint(checkpoint).is_final:
            log.info(
                "Run at %s already finished %d/%d steps: nothing to resume.",
                checkpoint,
                state.completed_steps,
                self.training.max_steps,
            )
            self.next_step = state.completed_steps
            self.eval_results = dict(state.eval)
            return True
        self.freshness.forget()
        self._sync_engine(self.backend.load(checkpoint))
        self.data.load_state_dict(state.data)
        # a graceful stop kept the batches sampled ahead: train on them as planned (the producer starts after them)
        self._resumed_ahead = load_sampled_ahead(checkpoint, self.max_staleness)
        if self._resumed_ahead:
            self.data.load_state_dict(self._resumed_ahead[-1].data_after)
        self.algorithm.load_state_dict(state.algorithm)
        self.batching.load_state_dict(state.batching)
        self.total_correct = state.total_correct
        self.total_completions = state.total_completions
        self.eval_results = dict(state.eval)
        self.wandb_run_id = state.wandb_run_id
        _set_rng_state(state.rng)
        self.next_step = state.completed_steps
        self._last_saved_step = state.step
        source_run = RunDir.of_checkpoint(checkpoint)
        for log_file in (self.metrics, self.steps_log, self.generations_log) if self.world.is_main else ():
            source = source_run.path / log_file.path.relative_to(self.run_dir)
            log_file.restore_from(source, last_step=state.step)
        log.info("Resumed from %s at step %d", checkpoint, self.next_step)
        return False


def _no_update() -> TrainResult:
    """A step whose every group was uniform: nothing to train on."""
    return TrainResult(loss=0.0, grad_norm=0.0, skipped_nonfinite=False, num_tokens=0)


def _rng_state() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    return {
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
        "python": [version, list(internal), gauss],
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["torch"])), dtype=torch.uint8))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
