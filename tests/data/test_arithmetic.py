"""The generated addition task: fixed problems, seeded order, disjoint held-out set, resumable cursor."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from retrain.config import compose
from retrain.data.arithmetic import SCHEMAS, ArithmeticData, ArithmeticDataConfig, draw_problems
from retrain.data.base import DataSource
from retrain.errors import ConfigError
from retrain.run import build_part

CONF_FILE = Path(__file__).resolve().parents[2] / "conf" / "data" / "arithmetic.yaml"


def ids(examples) -> list[str]:
    return [example.id for example in examples]


def test_examples_are_well_formed_additions() -> None:
    data = ArithmeticData(ArithmeticDataConfig(num_examples=50, held_out_size=10), seed=0)
    for example in data.next_batch(50) + data.held_out(10):
        a, b = (int(x) for x in example.id.split("+"))
        assert 10 <= a <= 99 and 10 <= b <= 99
        assert example.prompt == f"What is {a}+{b}?"
        assert example.reference == str(a + b)
        assert example.extra == {"question": example.prompt}  # what reward=judge fills `{question}` with


def test_same_seed_gives_same_order_and_other_seed_only_reorders() -> None:
    first, again, other = (ArithmeticData(ArithmeticDataConfig(num_examples=200), seed=s) for s in (7, 7, 8))
    batches = [ids(first.next_batch(64)) for _ in range(5)]  # crosses an epoch boundary
    assert batches == [ids(again.next_batch(64)) for _ in range(5)]
    other_batches = [ids(other.next_batch(64)) for _ in range(5)]
    assert other_batches != batches
    assert set(ids(first.train_examples)) == set(ids(other.train_examples))


def test_problem_set_depends_on_task_seed_only() -> None:
    base = ArithmeticData(ArithmeticDataConfig(num_examples=100, held_out_size=20), seed=0)
    reseeded = ArithmeticData(ArithmeticDataConfig(num_examples=100, held_out_size=20, task_seed=1), seed=0)
    assert set(ids(base.train_examples)) != set(ids(reseeded.train_examples))
    assert ids(ArithmeticData(ArithmeticDataConfig(num_examples=100, held_out_size=20), seed=5).held_out(20)) == ids(
        base.held_out(20)
    )


def test_held_out_is_disjoint_from_training_and_stable() -> None:
    data = ArithmeticData(ArithmeticDataConfig(), seed=0)
    train = set(ids(data.train_examples))
    held_out = ids(data.held_out(500))
    assert len(set(held_out)) == 500 and not train & set(held_out)
    assert len(train) == len(data) == 4000
    # Asking for fewer is a prefix; a bigger training set keeps the held-out problems.
    assert ids(data.held_out(20)) == held_out[:20]
    assert ids(ArithmeticData(ArithmeticDataConfig(num_examples=6000), seed=0).held_out(500)) == held_out
    # Served as drawn (the task order is already random): the tiny model's measured accuracy relies on it.
    assert held_out == [f"{a}+{b}" for a, b in draw_problems(4500, 10, 99, 0)[:500]]


def test_cursor_round_trip_reproduces_the_order() -> None:
    original = ArithmeticData(ArithmeticDataConfig(num_examples=100), seed=3)
    original.next_batch(150)  # into the second epoch
    state = original.state_dict()
    expected = [ids(original.next_batch(40)) for _ in range(4)]
    restored = ArithmeticData(ArithmeticDataConfig(num_examples=100), seed=99)  # the seed comes back from the state
    restored.load_state_dict(state)
    assert [ids(restored.next_batch(40)) for _ in range(4)] == expected
    with pytest.raises(ConfigError, match="cursor is for 100 examples but data=arithmetic now has 120"):
        ArithmeticData(ArithmeticDataConfig(num_examples=120), seed=3).load_state_dict(state)


def test_satisfies_the_data_source_protocol() -> None:
    assert isinstance(ArithmeticData(ArithmeticDataConfig(num_examples=10, held_out_size=0), seed=0), DataSource)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_examples": 8000, "held_out_size": 500}, "8500 distinct problems"),
        ({"min_value": 50, "max_value": 10}, "data.min_value=50"),
        ({"num_examples": 0}, "data.num_examples"),
        ({"held_out_size": -1}, "data.held_out_size"),
    ],
)
def test_bad_settings_are_named(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ArithmeticData(ArithmeticDataConfig(**kwargs), seed=0)


def test_held_out_request_beyond_the_set_is_named() -> None:
    with pytest.raises(ConfigError, match="more than the 10 held-out examples of data=arithmetic.*data.held_out_size"):
        ArithmeticData(ArithmeticDataConfig(num_examples=10, held_out_size=10), seed=0).held_out(11)
    assert ArithmeticData(ArithmeticDataConfig(num_examples=10, held_out_size=0), seed=0).held_out(0) == []


@settings(max_examples=60, deadline=None)
@given(
    min_value=st.integers(0, 1000),
    span=st.integers(1, 12),
    held_out_size=st.integers(0, 20),
    num_examples=st.integers(1, 40),
    task_seed=st.integers(0, 2**31),
)
def test_problems_are_distinct_and_in_range(
    min_value: int, span: int, held_out_size: int, num_examples: int, task_seed: int
) -> None:
    max_value = min_value + span - 1
    config = ArithmeticDataConfig(
        num_examples=num_examples,
        held_out_size=held_out_size,
        min_value=min_value,
        max_value=max_value,
        task_seed=task_seed,
    )
    if held_out_size + num_examples > span * span:
        with pytest.raises(ConfigError, match="distinct problems"):
            ArithmeticData(config, seed=0)
        return
    data = ArithmeticData(config, seed=0)
    examples = data.train_examples + data.held_out(held_out_size)
    assert len(set(ids(examples))) == num_examples + held_out_size
    for example in examples:
        a, b = (int(x) for x in example.id.split("+"))
        assert min_value <= a <= max_value and min_value <= b <= max_value
        assert int(example.reference) == a + b


def test_yaml_option_is_typed_by_the_schema_and_matches_its_defaults() -> None:
    assert SCHEMAS == {"base_arithmetic": ArithmeticDataConfig}
    assert OmegaConf.load(CONF_FILE).defaults == ["base_arithmetic"]
    cfg = compose(["data=arithmetic"])
    # The bundled tiny model was warm-started on the default problems: the option must not drift.
    assert cfg.data == OmegaConf.structured(ArithmeticDataConfig())
    data = build_part(cfg, "data", seed=0)
    assert isinstance(data, ArithmeticData) and len(data) == 4000


def test_wrong_keys_and_types_fail_when_composed() -> None:
    with pytest.raises(Exception, match="max_valu"):
        compose(["data=arithmetic", "data.max_valu=9"])
    with pytest.raises(Exception, match="num_examples"):
        compose(["data=arithmetic", "data.num_examples=many"])
