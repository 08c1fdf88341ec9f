"""What a run on several ranks refuses before any model loads, each with the key to change."""

from __future__ import annotations

import pytest

from retrain.commands.explain import composed
from retrain.distributed.world import World
from retrain.errors import ConfigError
from retrain.run import check_data_parallel, plan_parts

TWO = World(rank=1, size=2)


def refusal(overrides: list[str], preset: str = "experiment=quickstart") -> str:
    cfg = composed([preset, *overrides])
    with pytest.raises(ConfigError) as raised:
        check_data_parallel(cfg, plan_parts(cfg), TWO)
    return str(raised.value)


def test_the_quickstart_runs_on_two_ranks() -> None:
    cfg = composed(["experiment=quickstart"])
    check_data_parallel(cfg, plan_parts(cfg), TWO)


def test_fewer_prompts_than_ranks_is_refused() -> None:
    assert refusal(["training.batch_size=1", "eval.num_examples=0"]).startswith(
        "training.batch_size=1, eval.num_examples=0: a run on 2 ranks (docs/distributed.md) gives each rank"
    )


def test_a_last_held_out_batch_smaller_than_the_world_is_refused() -> None:
    assert "eval.num_examples=17" in refusal(["eval.num_examples=17"])


def test_a_backend_that_cannot_all_reduce_is_refused() -> None:
    message = refusal([], preset="backend=tinker")  # composes without a model download or an API key
    assert "cannot train data-parallel" in message and "needs backend=local" in message
