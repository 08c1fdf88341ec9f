"""A generated addition task: the offline quickstart's data, needing no download.

The problem set is drawn from a fixed *task* seed, independent of the training seed, so every run
(and the bundled tiny model's warm start) sees the same problems and the same held-out set; the
training seed only changes the order in which the problems are served.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from retrain.data.base import ExampleData
from retrain.errors import ConfigError
from retrain.plugins import built_in
from retrain.settings_object import takes_settings
from retrain.types import Example

PROMPT_TEMPLATE = "What is {a}+{b}?"


@dataclass
class ArithmeticDataConfig:
    """Schema of conf/data/arithmetic.yaml (defaults: 2-digit additions)."""

    _target_: str = "retrain.data.arithmetic.ArithmeticData"
    num_examples: int = 4000  # training problems
    held_out_size: int = 500  # problems kept apart for before/after accuracy
    min_value: int = 10  # smallest operand
    max_value: int = 99  # largest operand
    task_seed: int = 0  # fixes which problems exist; not the training seed

    def __post_init__(self) -> None:
        if self.num_examples < 1:
            raise ConfigError(f"data.num_examples must be at least 1, got {self.num_examples}")
        if self.held_out_size < 0:
            raise ConfigError(f"data.held_out_size must not be negative, got {self.held_out_size}")
        if self.min_value > self.max_value:
            raise ConfigError(f"data.min_value={self.min_value} must not exceed data.max_value={self.max_value}")


SCHEMAS: dict[str, type] = {"base_arithmetic": ArithmeticDataConfig}


def addition_example(a: int, b: int) -> Example:
    """The example for `a + b`; its id names the problem so logs and dedup can rely on it."""
    question = PROMPT_TEMPLATE.format(a=a, b=b)  # the whole prompt: a judge's `{question}` reads it from extra
    return Example(prompt=question, reference=str(a + b), id=f"{a}+{b}", extra={"question": question})


def draw_problems(count: int, min_value: int, max_value: int, task_seed: int) -> list[tuple[int, int]]:
    """`count` distinct operand pairs, drawn without replacement in a task-seeded order."""
    span = max_value - min_value + 1
    if count > span * span:
        raise ConfigError(
            f"data asks for {count} distinct problems but operands in "
            f"[{min_value}, {max_value}] give only {span * span}"
        )
    # Sampling indices of the span x span grid keeps memory flat even for huge operand ranges.
    indices = random.Random(task_seed).sample(range(span * span), count)
    return [(min_value + i // span, min_value + i % span) for i in indices]


@built_in
@takes_settings(ArithmeticDataConfig)
class ArithmeticData(ExampleData):
    """Addition problems served in a seeded, resumable order, plus a disjoint held-out set."""

    def __init__(self, config: ArithmeticDataConfig, seed: int) -> None:
        # Held-out problems come first in the task order, so the held-out set does not change
        # when num_examples does; that order is already random, so it is served as drawn.
        held_out_size = config.held_out_size
        pairs = draw_problems(held_out_size + config.num_examples, config.min_value, config.max_value, config.task_seed)
        held_out = [addition_example(a, b) for a, b in pairs[:held_out_size]]
        super().__init__(
            name="arithmetic",
            train=[addition_example(a, b) for a, b in pairs[held_out_size:]],
            seed=seed,
            held_out=lambda: held_out,
            shuffle_held_out=False,
            held_out_setting="data.held_out_size",
        )
