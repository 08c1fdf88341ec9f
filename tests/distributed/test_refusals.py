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


def test_split_mode_is_refused_before_the_data_and_model_load() -> None:
    """Not only when the backend is built, after the tokenizer and the data: the check `retrain explain` makes too."""
    assert refusal(["backend.devices='cpu,cpu'"]).startswith(
        "backend.devices='cpu,cpu': split mode runs on one process; a run on 2 ranks gives each rank one device"
    )


def test_a_backend_that_cannot_all_reduce_is_refused() -> None:
    message = refusal([], preset="backend=tinker")  # composes without a model download or an API key
    assert "cannot train data-parallel" in message and "needs backend=local" in message


@pytest.mark.parametrize(
    "engine",
    [
        ["inference=vllm"],
        ["inference=vllm_server", "inference.url=http://127.0.0.1:8000"],
        ["inference=sglang", "inference.url=[http://127.0.0.1:30000,http://127.0.0.1:30001]"],
        ["inference=openai", "inference.url=http://127.0.0.1:8000"],
    ],
)
def test_every_built_in_engine_samples_a_share(engine: list[str]) -> None:
    cfg = composed(["experiment=quickstart", *engine])
    check_data_parallel(cfg, plan_parts(cfg), TWO)


class WholeBatchEngine:
    """A plugin engine whose generate has no row_offset: it can only sample whole batches."""

    returns_entropies = False
    weights_version = 0

    def __init__(self, tokenizer: object = None, resources: object = None) -> None: ...

    def generate(self, prompt_ids, group_size, sampling, generator_seed): ...

    def sync(self, update) -> None: ...

    def probe_logprobs(self, probe): ...

    def close(self) -> None: ...


def test_an_engine_without_row_offset_is_refused() -> None:
    message = refusal([f"inference._target_={__name__}.WholeBatchEngine"])
    assert "WholeBatchEngine cannot sample a share of a batch" in message and "takes row_offset" in message
