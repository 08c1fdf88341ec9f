"""data=verifiers: a verifiers 0.4 environment as the run's task source, sampler of episodes and reward.

verifiers 0.4 (`verifiers.v1`) replaced 0.3's `load_environment(env_id, **args)`/`SingleTurnEnv`/`Rubric`:
an environment is a *taskset* (an installed package yielding `Task`s, whose `@vf.reward` methods are the
rubric), played by the agents of an `Env` (`SingleAgentEnv` unless the taskset exports its own, e.g. a
multi-turn env driving `agent.interaction(task).turn(...)`), each agent a *harness* program in a
*runtime*. `data.id` is the taskset id, `data.args` its config keys, `data.max_turns` every agent's
`max_turns`, `data.runtime` every agent's runtime.

Episodes run against the run's policy through verifiers' training client, which renders prompts with
the policy's tokenizer and calls our loopback endpoint's `/inference/v1/generate`
(retrain.inference.endpoint), so every trace carries the token ids and sampler log-probs of each model
turn. A trace's branch becomes one row (retrain.environments.base), its weighted reward the row's
reward; a failed episode is excluded (no verdict), like an unscored completion.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import json
import logging
import shutil
import subprocess
import threading
from collections.abc import Mapping
from typing import Any

from retrain.data.base import ExampleData
from retrain.environments.base import ScoredRollouts, Trajectory, rollouts_from_trajectories
from retrain.environments.config import VERIFIERS_VERSION, VerifiersDataConfig
from retrain.errors import ConfigError, UserError
from retrain.inference.completions import request_seed
from retrain.inference.endpoint import SERVED_MODEL, EngineEndpoint
from retrain.plugins import built_in
from retrain.settings_object import takes_settings
from retrain.types import Example, SamplingParams
from retrain.waiting import result_of

log = logging.getLogger(__name__)

API_KEY_VAR = "RETRAIN_ENDPOINT_API_KEY"  # unset: the loopback endpoint takes no key (verifiers sends "EMPTY")
# verifiers logs several lines per episode (rollout start/done, every intercepted request): warnings only
CHATTY_LOGGERS = ("verifiers", "aiohttp.access")


def parse_args(args: Any) -> dict[str, Any]:
    """`data.args` as a mapping: a mapping as given, or a JSON object string."""
    if args is None or args == "":
        return {}
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError as error:
            raise ConfigError(f"data.args is not valid JSON ({error}): {args!r}") from error
    if not isinstance(args, Mapping):
        raise ConfigError(f"data.args must be a mapping or a JSON object string, got {args!r}")
    return dict(args)


def module_of(env_id: str) -> str:
    """The module verifiers imports for a taskset id (a Hub id `owner/name@version` installs as `name`)."""
    return env_id.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_").lower()


def ensure_installed(env_id: str, auto_install: bool) -> None:
    """Fail with what to do when the environment's package is missing (or install it, with auto_install)."""
    module = module_of(env_id)
    if importlib.util.find_spec(f"verifiers.v1.tasksets.{module}") or importlib.util.find_spec(module):
        return
    if not auto_install:
        raise ConfigError(
            f"data.id={env_id!r}: environment package {module!r} is not installed; install it "
            f"(`prime env install {env_id}` or `pip install <its package>`) or set data.auto_install=true"
        )
    prime = shutil.which("prime")
    if prime is None:
        raise ConfigError(
            f"data.id={env_id!r} is not installed and data.auto_install=true needs the Prime CLI "
            "(`uv tool install prime`), which verifiers 0.4 installs environments with; or install it yourself"
        )
    log.info("data.auto_install: prime env install %s", env_id)
    result = subprocess.run([prime, "env", "install", env_id], capture_output=True, text=True)
    importlib.invalidate_caches()
    if result.returncode != 0 or importlib.util.find_spec(module) is None:
        raise ConfigError(
            f"data.auto_install: `prime env install {env_id}` did not install {module!r}: "
            f"{(result.stderr or result.stdout).strip()[-500:]}"
        )


@built_in
@takes_settings(VerifiersDataConfig)
class VerifiersEnvironment(ExampleData):
    """The taskset's tasks in a seeded, resumable order (ExampleData), sampled and scored by the environment."""

    def __init__(self, config: VerifiersDataConfig, seed: int) -> None:
        vf = _verifiers()
        for name in CHATTY_LOGGERS:
            logging.getLogger(name).setLevel(logging.WARNING)
        id, held_out_size = config.id, config.held_out_size
        ensure_installed(id, config.auto_install)
        self.env_id = id
        self.max_concurrent = config.max_concurrent
        self.env = vf.load_environment(_env_config(vf, id, parse_args(config.args), config.max_turns, config.runtime))
        self.tasks = _training_tasks(self.env.taskset, id)
        examples = [_example(task, index) for index, task in enumerate(self.tasks)]
        if held_out_size >= len(examples):
            raise ConfigError(
                f"data.held_out_size={held_out_size} leaves no training task of the {len(examples)} "
                f"of environment {id!r}"
            )
        cut = len(examples) - held_out_size
        held_out = examples[cut:]
        super().__init__(
            name=f"verifiers:{id}",
            train=examples[:cut],
            seed=seed,
            held_out=(lambda: held_out) if held_out_size else None,
            held_out_setting="data.held_out_size",
        )
        self._client: Any = None
        self._tokenizer: Any = None
        log.info(
            "verifiers %s environment %s (%s): %d tasks, %d held out; its reward replaces reward=",
            VERIFIERS_VERSION,
            self.env.config.env_id,
            type(self.env).__name__,
            len(examples),
            held_out_size,
        )

    def held_out(self, n: int) -> list[Example]:
        if self._load_held_out is None:
            raise ConfigError(f"environment {self.env_id!r} holds no tasks out: set data.held_out_size (e.g. 50)")
        return super().held_out(n)

    def connect(self, endpoint: EngineEndpoint, tokenizer: Any, tokenizer_path: str) -> None:
        vf = _verifiers()
        self._tokenizer = tokenizer
        self._client = vf.TrainClientConfig(
            base_url=endpoint.url, api_key_var=API_KEY_VAR, renderer_model_name=tokenizer_path
        )

    def sample(
        self, examples: list[Example], group_size: int, sampling: SamplingParams, seed: int | None
    ) -> ScoredRollouts:
        if self._client is None:
            raise RuntimeError("VerifiersEnvironment.sample before connect(): the run wires the endpoint first")
        future = asyncio.run_coroutine_threadsafe(self._episodes(examples, group_size, sampling, seed), _episode_loop())
        try:
            episodes = result_of(future)
        except BaseException:  # a stop (KeyboardInterrupt) while waiting: the episodes end with the caller
            future.cancel()
            raise
        groups = [
            [self._trajectory(e) for e in episodes[b * group_size : (b + 1) * group_size]] for b in range(len(examples))
        ]
        self._report_excluded(episodes)
        pad_id = (
            self._tokenizer.pad_token_id if self._tokenizer.pad_token_id is not None else self._tokenizer.eos_token_id
        )
        scored = rollouts_from_trajectories(
            groups, sampling, pad_id, lambda ids: self._tokenizer.decode(ids, skip_special_tokens=True)
        )
        scored.rollouts.metrics["env/mean_turns"] = sum(e.num_turns for e in episodes) / len(episodes)
        return scored

    async def _episodes(
        self, examples: list[Example], group_size: int, sampling: SamplingParams, seed: int | None
    ) -> list[Any]:
        vf = _verifiers()
        gate = asyncio.Semaphore(self.max_concurrent)
        runs = []
        async with self.env.serving():
            for b, example in enumerate(examples):
                task = self.tasks[example.extra["task_index"]]
                base = request_seed(seed, b)
                for g in range(group_size):
                    settings = vf.SamplingConfig(
                        temperature=sampling.temperature,
                        top_p=sampling.top_p,
                        max_tokens=sampling.max_tokens,
                        seed=None if base is None else base + g,
                    )
                    context = vf.ModelContext(model=SERVED_MODEL, client=self._client, sampling=settings)
                    (slot,) = self.env.slots(task, 1)
                    runs.append(self.env.run_slot(slot, context, gate))
            return list(await asyncio.gather(*runs))

    def _report_excluded(self, episodes: list[Any]) -> None:
        """One warning line for the step's excluded episodes (failed, or branched); all of them excluded: stop."""
        failed = [e for e in episodes if not e.ok]
        branched = [e for e in episodes if e.ok and len(_trainable_branches(e)) > 1]
        if not failed and not branched:
            return
        if failed:
            error = failed[0].last_error or next((t.last_error for t in failed[0].traces if t.last_error), None)
            detail = f"{error.type}: {error.message}" if error else "no error recorded"
        else:
            detail = (
                f"{len(_trainable_branches(branched[0]))} trainable branches (agents, compactions, or a later turn "
                "whose tokens do not extend the earlier ones); retrain trains one row per rollout"
            )
        if len(failed) + len(branched) == len(episodes):
            raise UserError(f"environment {self.env_id!r}: every episode of the step was excluded; the first: {detail}")
        log.warning(
            "environment %s: %d/%d episodes excluded (%d failed, %d branched); the first: %s",
            self.env_id,
            len(failed) + len(branched),
            len(episodes),
            len(failed),
            len(branched),
            detail,
        )

    def _trajectory(self, episode: Any) -> Trajectory:
        """The episode's one trainable branch as a row; no verdict when the episode failed, branched or was not
        scored."""
        branches = _trainable_branches(episode)
        if len(branches) != 1 or not episode.ok:
            return Trajectory([], [], [], [], reward=None, timed_out=episode.is_timeout)
        trace, branch = branches[0]
        mask = branch.sampled_mask
        if True not in mask:
            return Trajectory([], [], [], [], reward=None)
        start = mask.index(True)
        tokens, logprobs = branch.token_ids, branch.logprobs
        scored = trace.rewards and all(reward is not None for reward in trace.rewards.values())
        return Trajectory(
            prompt_ids=tokens[:start],
            completion_ids=tokens[start:],
            sampled=mask[start:],
            logprobs=logprobs[start:],
            reward=trace.reward if scored else None,
            hit_max_tokens=trace.is_truncated,
            timed_out=trace.is_timeout,
        )


_loop: asyncio.AbstractEventLoop | None = None
_loop_guard = threading.Lock()


def _episode_loop() -> asyncio.AbstractEventLoop:
    """The process's one event loop for verifiers episodes, run by a daemon thread. verifiers' renderers keep
    module-level asyncio state (a lock that binds to the first loop that waits on it), so episodes on a second loop
    in the same process (a second environment, the next job of an in-process sweep) would fail on it."""
    global _loop
    with _loop_guard:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="retrain-verifiers", daemon=True).start()
        return _loop


def _trainable_branches(episode: Any) -> list[tuple[Any, Any]]:
    """(trace, branch) for each trainable branch of the episode's trainable agents."""
    traces = [t for t in episode.traces if t.agent.trainable]
    return [(t, b) for t in traces for b in t.branches if b.trainable]


def _verifiers() -> Any:
    try:
        import verifiers
        import verifiers.v1 as vf
    except ImportError as error:
        raise ConfigError(
            f"data=verifiers needs verifiers {VERIFIERS_VERSION}: pip install 'retrain[verifiers]' ({error})"
        ) from error
    if not verifiers.__version__.startswith(VERIFIERS_VERSION.rsplit(".", 1)[0]):
        raise ConfigError(
            f"data=verifiers is written for verifiers {VERIFIERS_VERSION} (the verifiers.v1 API), "
            f"found {verifiers.__version__}: pip install 'retrain[verifiers]'"
        )
    return vf


def _env_config(vf: Any, env_id: str, args: dict[str, Any], max_turns: int, runtime: str) -> Any:
    """The environment's config: the taskset's keys from data.args; every agent seat on `runtime`, capped at
    `max_turns` (its own harness and other settings as the environment declares them)."""
    from pydantic import ValidationError

    try:
        taskset = {**args, "id": env_id}
        roles = vf.env_config_type(env_id).model_fields
        seats = {name for name, info in roles.items() if isinstance(info.default, vf.AgentConfig)}
        override: dict[str, Any] = {"runtime": {"type": runtime}}
        if max_turns > 0:
            override["max_turns"] = max_turns
        return vf.resolve_env_config({"taskset": taskset, **{seat: dict(override) for seat in seats}})
    except ValidationError as error:
        raise ConfigError(f"data.args do not fit environment {env_id!r}: {error}") from error
    except (ModuleNotFoundError, TypeError, AttributeError, ValueError) as error:
        raise ConfigError(
            f"data.id={env_id!r} is not a loadable verifiers {VERIFIERS_VERSION} taskset: {error}"
        ) from error


def _training_tasks(taskset: Any, env_id: str) -> list[Any]:
    """Every task the taskset yields for these args; none (an evaluation-only environment) fails now."""
    if not taskset.bounded:
        raise ConfigError(
            f"environment {env_id!r} yields tasks forever: bound it through data.args (its own size/split keys)"
        )
    tasks = list(taskset)
    if not tasks:
        raise ConfigError(
            f"environment {env_id!r} has no training tasks for data.args (it may be evaluation-only): "
            "choose a training split through data.args (e.g. data.args={split: train}) or another environment"
        )
    return tasks


def _example(task: Any, index: int) -> Example:
    data = task.data
    return Example(
        prompt=data.prompt_text,
        reference=str(getattr(data, "answer", "") or ""),
        id=str(data.id or data.name or data.idx),
        extra={"task_index": index},
    )
