"""Every conf/reward option composes, instantiates to a picklable callable, and scores."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from retrain.config import compose, config_dir
from retrain.reward.config import SCHEMAS, JudgeRewardConfig, MathRewardConfig
from retrain.reward.math import MathReward
from retrain.run import build_part

OPTIONS = sorted(path.stem for path in (Path(config_dir()) / "reward").glob("*.yaml"))


def test_every_option_has_a_schema() -> None:
    assert OPTIONS == ["judge", "match", "math"]
    assert set(SCHEMAS) == {f"base_{option}" for option in OPTIONS}


@pytest.mark.parametrize("option", OPTIONS)
def test_option_instantiates_to_a_callable_the_workers_can_load(option: str) -> None:
    reward = build_part(compose([f"reward={option}"]), "reward")
    assert callable(reward)
    assert callable(pickle.loads(pickle.dumps(reward)))


@pytest.mark.parametrize("option", ["match", "math"])
def test_offline_options_score_a_correct_answer(option: str) -> None:
    reward = build_part(compose([f"reward={option}"]), "reward")
    assert reward("so \\boxed{4}", "4", question="2+2?") == 1.0
    assert reward("so \\boxed{5}", "4", question="2+2?") == 0.0


def test_a_typo_fails_when_the_config_is_composed() -> None:
    with pytest.raises(Exception, match="parse_timeout"):
        compose(["reward=math", "reward.parse_timeout=3"])


def test_the_schema_holds_each_default_once_and_the_rewards_take_theirs_from_it() -> None:
    judge = build_part(compose(["reward=judge"]), "reward")
    schema = JudgeRewardConfig()
    assert judge.config == schema and judge.url == schema.base_url + "/chat/completions"
    math = build_part(compose(["reward=math"]), "reward")
    assert (math.parse_timeout_s, math.cache_size) == (
        MathReward(MathRewardConfig()).parse_timeout_s,
        MathRewardConfig.cache_size,
    )
