"""data=agent: any agent function as the run's task source and sampler, trained through an OpenAI-compatible endpoint.

`data.agent=module:function` names `run_episode(task: dict, base_url: str, model: str) -> float` (or `async def`):
given a task (a row of `data.tasks`), it calls `<base_url>/chat/completions` as often as it likes, with any
client (the official `openai` one works), tools included, and returns the episode's reward. Each episode gets a
base_url of its own on the run's loopback endpoint (retrain.inference.endpoint), whose calls a ChatEpisode
(retrain.environments.chat_episode) samples from the run's engine and records token in, token out; the episode
becomes one row (the model's tokens trained, the rest context), its reward the agent's float or, with
`data.reward_from=reward`, the run's `reward=` scorer on the last reply.

Episodes run in threads of their own (an async agent in its own event loop there), at most `data.max_concurrent` at
once, each bounded by `data.timeout_s`: an agent that hangs (even blocking its thread) is abandoned, its endpoint
route closed, and the run goes on. An episode that raises, times out, returns no finite number, never calls the
model or branches is excluded like an unscored completion and counted in one warning line per step; a step whose
every episode fails stops the run with the first failure. Episode g of task b samples with the seed
hash(step seed, b) + g, and its call k with hash(that seed, k): the same seed gives the same rollouts whatever
`data.max_concurrent` is (the engine's batches do not change what a request samples).
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import logging
import math
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import Any

from retrain.data.base import ExampleData
from retrain.data.jsonl import load_records, require_fields
from retrain.environments.base import ScoredRollouts, Trajectory, rollouts_from_trajectories
from retrain.environments.chat_episode import ChatEpisode
from retrain.environments.config import AgentDataConfig
from retrain.errors import ConfigError, UserError
from retrain.inference.completions import request_seed
from retrain.inference.endpoint import SERVED_MODEL, EngineEndpoint
from retrain.plugins import built_in
from retrain.settings_object import takes_settings
from retrain.types import Example, SamplingParams
from retrain.waiting import SIGNAL_POLL_S

log = logging.getLogger(__name__)


def load_agent(target: str) -> Callable[..., Any]:
    """The function `module:function` names, or a ConfigError naming data.agent."""
    module_name, _, name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ConfigError(f"data.agent={target!r}: cannot import {module_name!r} ({error})") from error
    function = getattr(module, name, None)
    if not callable(function):
        raise ConfigError(f"data.agent={target!r}: module {module_name!r} has no function {name!r}")
    return function


@dataclass
class Outcome:
    """How one episode ended: its reward, or why it has none."""

    reward: float | None = None
    failure: str | None = None  # a short kind: raised, timed out, no reward, never called the model, branched
    detail: str = ""
    timed_out: bool = False


@built_in
@takes_settings(AgentDataConfig)
class AgentEnvironment(ExampleData):
    """The tasks in a seeded, resumable order (ExampleData), each sampled as episodes of the user's agent."""

    def __init__(self, config: AgentDataConfig, seed: int) -> None:
        self.agent_name = config.agent
        self.run_episode = load_agent(config.agent)
        self.max_concurrent = config.max_concurrent
        self.timeout_s = config.timeout_s
        self.uses_reward = config.reward_from == "reward"
        records = load_records(config.tasks, config.split, config.config_name or None, setting="data.tasks")
        fields = {"data.answer_field": config.answer_field} if self.uses_reward else {}
        if config.id_field:
            fields["data.id_field"] = config.id_field
        require_fields(records, fields, config.tasks)
        self.tasks = [dict(record) for record in records]
        examples = [
            Example(
                prompt=str(task.get(config.question_field, "")),
                reference=str(task.get(config.answer_field, "")).strip(),
                id=str(task[config.id_field]) if config.id_field else f"{config.split}/{index}",
                extra={"task_index": index},
            )
            for index, task in enumerate(self.tasks)
        ]
        if config.held_out_size >= len(examples):
            raise ConfigError(
                f"data.held_out_size={config.held_out_size} leaves no training task of the {len(examples)} "
                f"in data.tasks={config.tasks!r}"
            )
        cut = len(examples) - config.held_out_size
        held_out = examples[cut:]
        super().__init__(
            name=f"agent:{config.agent}",
            train=examples[:cut],
            seed=seed,
            held_out=(lambda: held_out) if config.held_out_size else None,
            held_out_setting="data.held_out_size",
        )
        self._endpoint: EngineEndpoint | None = None
        self._tokenizer: Any = None

    def held_out(self, n: int) -> list[Example]:
        if self._load_held_out is None:
            raise ConfigError(f"data={self.name} holds no tasks out: set data.held_out_size (e.g. 50)")
        return super().held_out(n)

    def connect(self, endpoint: EngineEndpoint, tokenizer: Any, tokenizer_path: str) -> None:
        self._endpoint = endpoint
        self._tokenizer = tokenizer

    def sample(
        self, examples: list[Example], group_size: int, sampling: SamplingParams, seed: int | None
    ) -> ScoredRollouts:
        endpoint, tokenizer = self._endpoint, self._tokenizer
        if endpoint is None:
            raise RuntimeError("AgentEnvironment.sample before connect(): the run wires the endpoint first")
        episodes: list[tuple[dict[str, Any], ChatEpisode]] = []  # (task, episode)
        for b, example in enumerate(examples):
            base = request_seed(seed, b)
            for g in range(group_size):
                episode = ChatEpisode(
                    tokenizer, sampling, None if base is None else base + g, endpoint.complete, endpoint.max_model_len
                )
                episodes.append((self.tasks[example.extra["task_index"]], episode))
        outcomes = self._run(episodes, endpoint)
        trajectories = [self._row(episode, outcome) for (_, episode), outcome in zip(episodes, outcomes, strict=True)]
        self._report(outcomes)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        groups = [trajectories[b * group_size : (b + 1) * group_size] for b in range(len(examples))]
        scored = rollouts_from_trajectories(
            groups, sampling, pad_id, lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
        )
        scored.rollouts.metrics["env/mean_turns"] = sum(e.calls for _, e in episodes) / len(episodes)
        if self.uses_reward:
            scored.answers = [episode.answer for _, episode in episodes]
        return scored

    def _row(self, episode: ChatEpisode, outcome: Outcome) -> Trajectory:
        """The episode's row; an episode that failed keeps no tokens (and no verdict)."""
        if outcome.failure is None:
            if episode.refused is not None:
                outcome.failure, outcome.detail = "branched", episode.refused
            elif not episode.calls:
                outcome.failure, outcome.detail = "never called the model", ""
        if outcome.failure is not None:
            outcome.reward = None
            return Trajectory([], [], [], [], reward=None, timed_out=outcome.timed_out)
        return episode.trajectory(0.0 if self.uses_reward else outcome.reward)

    def _run(self, episodes: list[tuple[dict[str, Any], ChatEpisode]], endpoint: EngineEndpoint) -> list[Outcome]:
        """Run every episode, at most max_concurrent at once, each abandoned after timeout_s."""
        outcomes: list[Outcome | None] = [None] * len(episodes)
        running: dict[Future[float], tuple[int, float]] = {}  # an episode's result -> (its index, its deadline)
        keys = [uuid.uuid4().hex for _ in episodes]  # never reused: an abandoned agent cannot reach a later episode
        started = 0
        while started < len(episodes) or running:
            while started < len(episodes) and len(running) < self.max_concurrent:
                task, episode = episodes[started]
                url = endpoint.serve_episode(keys[started], episode)
                running[self._start(task, url)] = (started, time.monotonic() + self.timeout_s)
                started += 1
            deadline = min(deadline for _, deadline in running.values())
            timeout = min(SIGNAL_POLL_S, max(0.0, deadline - time.monotonic()))  # a stop's handler runs meanwhile
            finished, _ = wait(list(running), timeout, FIRST_COMPLETED)
            now = time.monotonic()
            for future in list(running):
                index, deadline = running[future]
                if future in finished:
                    outcomes[index] = _outcome(future)
                elif now >= deadline:
                    outcomes[index] = Outcome(failure="timed out", detail=f"after {self.timeout_s:g} s", timed_out=True)
                else:
                    continue
                endpoint.end_episode(keys[index])
                del running[future]
        return [outcome if outcome is not None else Outcome(failure="lost") for outcome in outcomes]

    def _start(self, task: dict[str, Any], url: str) -> Future[float]:
        """run_episode(task, url, model) on a daemon thread (an async agent in an event loop of its own there):
        a hung agent is abandoned without holding the run or its exit."""
        result: Future[float] = Future()

        def episode() -> None:
            try:
                value = self.run_episode(dict(task), url, SERVED_MODEL)
                if inspect.isawaitable(value):  # an async def, or a function that returns a coroutine
                    value = asyncio.run(_awaited(value))
                result.set_result(value)
            except BaseException as error:  # the agent's failure is the episode's outcome
                result.set_exception(error)

        threading.Thread(target=episode, name="retrain-agent-episode", daemon=True).start()
        return result

    def _report(self, outcomes: list[Outcome]) -> None:
        """One warning line per step with the failed episodes by kind and the first one's detail; all failed: stop."""
        failed = [outcome for outcome in outcomes if outcome.failure is not None]
        if not failed:
            return
        first = failed[0]
        detail = f"{first.failure}" + (f": {first.detail}" if first.detail else "")
        if len(failed) == len(outcomes):
            raise UserError(f"data.agent={self.agent_name}: every episode of the step failed; the first {detail}")
        kinds = ", ".join(f"{count} {kind}" for kind, count in Counter(o.failure for o in failed).items())
        log.warning(
            "data.agent=%s: %d/%d episodes excluded (%s); the first %s",
            self.agent_name,
            len(failed),
            len(outcomes),
            kinds,
            detail,
        )


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def _outcome(future: Future[float]) -> Outcome:
    error = future.exception()
    if error is not None:
        return Outcome(failure="raised", detail=f"{type(error).__name__}: {error}")
    value = future.result()
    if not isinstance(value, int | float) or not math.isfinite(value):  # a bool counts as 1.0 / 0.0
        return Outcome(failure="no reward", detail=f"run_episode returned {value!r}, not a finite number")
    return Outcome(reward=float(value))
