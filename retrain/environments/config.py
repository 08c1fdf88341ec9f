"""Schema of conf/data/verifiers.yaml; light (no verifiers import), since the CLI composes configs with it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
    max_concurrent: int = 16  # rollouts in flight at once (the engine still samples one request at a time)


SCHEMAS: dict[str, type] = {"base_verifiers": VerifiersDataConfig}
