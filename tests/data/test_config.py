"""The `data` group's schemas: one per option, the generated task's included."""

from __future__ import annotations

from pathlib import Path

import pytest

from retrain.config import compose, config_dir
from retrain.data.config import SCHEMAS


def test_every_data_option_has_a_schema() -> None:
    options = sorted(path.stem for path in (Path(config_dir()) / "data").glob("*.yaml"))
    assert {"arithmetic", "gsm8k", "jsonl", "math"} <= set(options)
    assert {f"base_{option}" for option in options} <= set(SCHEMAS)


def test_the_default_is_the_seeds_math_setup() -> None:
    data = compose().data
    assert data._target_ == "retrain.data.math.MathData" and data.path == "EleutherAI/hendrycks_math"
    assert list(data.subjects) == [
        "intermediate_algebra",
        "precalculus",
        "number_theory",
        "counting_and_probability",
        "geometry",
    ]
    assert (data.split, data.held_out_split, data.max_examples) == ("train", "test", 0)


def test_wrong_types_fail_when_composed() -> None:
    with pytest.raises(Exception, match="max_examples"):
        compose(["data.max_examples=many"])
    with pytest.raises(Exception, match="subject"):
        compose(["data.subject=[algebra]"])
