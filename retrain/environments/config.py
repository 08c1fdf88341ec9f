"""Schemas of conf/data/verifiers.yaml and conf/data/agent.yaml; light (no verifiers import), since the CLI composes configs with it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from retrain.errors import ConfigError

VERIFIERS_VERSION = "0.4.0"  # the verifiers release this integration is written and tested against
RUNTIMES = ("subprocess", "docker", "podman", "apptainer", "prime", "modal", "e2b")


@dataclass
class VerifiersDataConfig:
    """A verifiers environment (taskset + its agents + its rubric) as the run's task source and reward."""

    _target_: str = "retrain.environments.verifiers_env.VerifiersEnvironment"
    id: str = ""  # required: the taskset id (an installed package, e.g. gsm8k or primeintellect/gsm8k)
    args: Any = None  # the taskset's config keys: a mapping or a JSON object string (None: no keys)
    max_turns: int = -1  # model turns per rollout for every agent; -1 = the environment's default
    auto_install: bool = False  # a missing environment is installed with `prime env install <id>`
    runtime: str = "subprocess"  # where the agents' harness programs run (verifiers runtime type)
    held_out_size: int = 0  # the last N tasks are held out from training for eval.num_examples
    max_concurrent: int = 16  # rollouts in flight at once (their requests are sampled in shared engine batches)

    def __post_init__(self) -> None:
        if not self.id:
            raise ConfigError("data.id is empty: name the verifiers environment (its taskset id), e.g. data.id=gsm8k")
        if self.max_turns == 0 or self.max_turns < -1:
            raise ConfigError(f"data.max_turns must be -1 (the environment's default) or >= 1, got {self.max_turns}")
        if self.runtime not in RUNTIMES:
            raise ConfigError(f"data.runtime={self.runtime!r} is not one of {', '.join(RUNTIMES)}")
        if self.held_out_size < 0:
            raise ConfigError(f"data.held_out_size must not be negative, got {self.held_out_size}")
        if self.max_concurrent < 1:
            raise ConfigError(f"data.max_concurrent must be >= 1, got {self.max_concurrent}")


REWARD_FROM = ("agent", "reward")


@dataclass
class AgentDataConfig:
    """data=agent: any agent function, given each task and a base_url of the run's policy, trained on its calls."""

    _target_: str = "retrain.environments.agent_env.AgentEnvironment"
    tasks: str = ""  # required: a jsonl/json/parquet/csv file, a data set directory or a Hub id; a row is a task
    split: str = "train"
    config_name: str = ""
    agent: str = ""  # required: `module:function`, run_episode(task, base_url, model) -> float (async def allowed)
    reward_from: str = "agent"  # agent: the float run_episode returns; reward: `reward=` scores the last reply
    question_field: str = "question"  # the task's text as the run logs it (and `reward=`'s prompt)
    answer_field: str = "answer"  # the reference `reward=` compares against (reward_from=reward)
    id_field: str = ""  # "" = "<split>/<index>"
    held_out_size: int = 0  # the last N tasks are held out from training for eval.num_examples
    max_concurrent: int = 16  # episodes in flight at once (their calls are sampled in shared engine batches)
    timeout_s: float = 300.0  # an episode still running after this is abandoned and excluded

    def __post_init__(self) -> None:
        if not self.tasks:
            raise ConfigError("data.tasks is empty: name a jsonl file, a data set directory or a Hub id of tasks")
        module, _, function = self.agent.partition(":")
        if not module or not function:
            raise ConfigError(f"data.agent must be `module:function` (e.g. my_agent:run_episode), got {self.agent!r}")
        if self.reward_from not in REWARD_FROM:
            raise ConfigError(f"data.reward_from={self.reward_from!r} is not one of {', '.join(REWARD_FROM)}")
        if self.held_out_size < 0:
            raise ConfigError(f"data.held_out_size must not be negative, got {self.held_out_size}")
        if self.max_concurrent < 1:
            raise ConfigError(f"data.max_concurrent must be >= 1, got {self.max_concurrent}")
        if not self.timeout_s > 0:
            raise ConfigError(f"data.timeout_s must be > 0 seconds, got {self.timeout_s}")


SCHEMAS: dict[str, type] = {"base_verifiers": VerifiersDataConfig, "base_agent": AgentDataConfig}
