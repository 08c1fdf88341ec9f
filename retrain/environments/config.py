"""Schema of conf/data/verifiers.yaml; light (no verifiers import), since the CLI composes configs with it."""

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


SCHEMAS: dict[str, type] = {"base_verifiers": VerifiersDataConfig}
