"""data=agent on the tiny model: the example agent's episodes as rows, the same rollouts whatever max_concurrent is,
faulty agents excluded in bounded time, config errors named, and a run that trains end to end."""

from __future__ import annotations

import json
import logging
import time

import pytest
import torch

from retrain.environments import arithmetic_agent
from retrain.environments.agent_env import AgentEnvironment
from retrain.environments.config import AgentDataConfig
from retrain.errors import ConfigError, UserError
from retrain.inference.endpoint import EngineEndpoint
from retrain.types import SamplingParams, TrainBatch
from tests.backend.tiny_model import make_backend, make_engine, tokenizer_of
from tests.conftest import read_metrics, run_cli
from tests.environments import agents
from tests.environments.conftest import tiny_run_args

EXAMPLE = "retrain.environments.example_agent:run_episode"
ARITHMETIC = "retrain.environments.arithmetic_agent:run_episode"
SAMPLING = SamplingParams(max_tokens=6, temperature=1.0)


def write_tasks(path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def sums(n: int) -> list[dict]:
    return [{"question": f"What is {a}+{a + 3}?", "answer": str(2 * a + 3)} for a in range(1, n + 1)]


@pytest.fixture
def backend(tiny_spec):
    return make_backend(tiny_spec)


@pytest.fixture
def served(backend, tiny_spec):
    endpoint = EngineEndpoint(make_engine(backend), max_model_len=128)
    yield endpoint, tokenizer_of(tiny_spec.name_or_path)
    endpoint.close()


def environment(served, tasks: str, agent: str = EXAMPLE, **options) -> AgentEnvironment:
    endpoint, tokenizer = served
    data = AgentEnvironment(AgentDataConfig(tasks=tasks, agent=agent, **options), seed=0)
    data.connect(endpoint, tokenizer, "unused")
    return data


def test_example_agent_episodes_are_the_same_rows_whatever_max_concurrent(served, backend, tmp_path):
    tasks = write_tasks(tmp_path / "tasks.jsonl", sums(6))
    scored = []
    for max_concurrent in (1, 16):
        data = environment(served, tasks, max_concurrent=max_concurrent)
        scored.append(data.sample(data.next_batch(2), 4, SAMPLING, seed=9))
        if max_concurrent == 1:
            assert served[0].batcher.most_in_flight == 1
    assert served[0].batcher.most_in_flight > 1  # 8 episodes' calls were in flight together, in shared batches
    one, many = scored
    assert torch.equal(one.rollouts.completion_ids, many.rollouts.completion_ids)
    assert torch.equal(one.rollouts.sampled_mask, many.rollouts.sampled_mask)
    # within fp32 rounding of matmuls over other row counts, as the engine's batching tests allow (test_kv_budget.py)
    torch.testing.assert_close(one.rollouts.logprobs, many.rollouts.logprobs, rtol=1e-5, atol=5e-5)
    assert torch.equal(one.rewards, many.rewards) and not one.excluded.any()
    rollouts = one.rollouts
    assert rollouts.metrics["env/mean_turns"] == 2.0
    for n in range(rollouts.num_rows):  # two model turns, and context between them (the nudge) that is not trained
        sampled = rollouts.sampled_mask[n][rollouts.completion_mask[n]].tolist()
        turns = sum(1 for i, s in enumerate(sampled) if s and (i == 0 or not sampled[i - 1]))
        assert turns == 2 and not all(sampled)
        assert (rollouts.logprobs[n][~rollouts.sampled_mask[n]] == 0).all()
        assert "Sure? Answer again." in rollouts.texts[n]
    assert one.answers is None  # the agent's rewards are final

    advantages = torch.where(rollouts.trained_mask, 1.0, 0.0)  # every token offered: only the model's may train
    result = backend.train(TrainBatch(rollouts, advantages, torch.ones(rollouts.num_rows, dtype=torch.bool)))
    assert result.num_tokens == int(rollouts.trained_mask.sum()) < int(rollouts.completion_mask.sum())


def test_the_arithmetic_agent_runs_three_model_turns_around_its_tool_and_follow_up(served, tmp_path):
    tasks = arithmetic_agent.write_tasks(tmp_path / "tasks.jsonl", 6)
    rows = [json.loads(line) for line in tasks.read_text().splitlines()]
    assert rows == arithmetic_agent.arithmetic_tasks(6) and len({row["question"] for row in rows}) == 6
    for row in rows:  # "What is a+b?" with c to subtract
        a, b = map(int, row["question"].removeprefix("What is ").removesuffix("?").split("+"))
        assert row["answer"] == str(a + b - row["c"]) and 1 <= row["c"] <= 9
    data = environment(served, str(tasks), agent=ARITHMETIC, max_concurrent=4)
    scored = data.sample(data.next_batch(2), 3, SAMPLING, seed=5)
    rollouts = scored.rollouts
    assert not scored.excluded.any() and rollouts.metrics["env/mean_turns"] == 3.0
    for n in range(rollouts.num_rows):  # three model turns, the nudge and the follow-up between them as context
        sampled = rollouts.sampled_mask[n][rollouts.completion_mask[n]].tolist()
        assert sum(1 for i, s in enumerate(sampled) if s and (i == 0 or not sampled[i - 1])) == 3
        assert arithmetic_agent.NUDGE in rollouts.texts[n] and "Minus " in rollouts.texts[n]


def test_an_agent_that_returns_a_coroutine_is_awaited(served, tmp_path):
    data = environment(
        served, write_tasks(tmp_path / "tasks.jsonl", sums(2)), agent="tests.environments.agents:returns_a_coroutine"
    )
    scored = data.sample(data.next_batch(1), 2, SAMPLING, seed=1)
    assert not scored.excluded.any() and scored.rollouts.metrics["env/mean_turns"] == 2.0


def test_reward_from_reward_leaves_the_last_replies_to_the_scorer(served, tmp_path):
    data = environment(served, write_tasks(tmp_path / "tasks.jsonl", sums(3)), reward_from="reward")
    scored = data.sample(data.next_batch(1), 2, SAMPLING, seed=1)
    assert scored.answers is not None and len(scored.answers) == 2
    assert all(answer in text for answer, text in zip(scored.answers, scored.rollouts.texts))


def test_faulty_agents_are_excluded_and_counted_in_one_line(served, tmp_path, caplog):
    faults = ["ok", "raise", "hang", "silent", "nan"]
    tasks = write_tasks(tmp_path / "tasks.jsonl", [{"question": "What is 1+1?", "fault": f} for f in faults])
    data = environment(served, tasks, agent="tests.environments.agents:faulty", timeout_s=10)
    examples = sorted(data.next_batch(5), key=lambda e: e.extra["task_index"])
    started = time.monotonic()
    try:
        with caplog.at_level(logging.WARNING, logger="retrain.environments.agent_env"):
            scored = data.sample(examples, 1, SAMPLING, seed=2)
    finally:
        agents.RELEASE.set()
    assert time.monotonic() - started < 60  # the hung agent was abandoned at its timeout
    assert scored.excluded.view(-1).tolist() == [False, True, True, True, True]
    assert scored.errors == 4 and scored.timeouts == 1
    assert scored.rollouts.completion_mask[1:].sum() == 0  # an excluded episode keeps no tokens
    lines = [r.getMessage() for r in caplog.records if "episodes excluded" in r.getMessage()]
    assert len(lines) == 1
    assert "4/5 episodes excluded (1 raised, 1 timed out, 1 never called the model, 1 no reward)" in lines[0]
    assert "ValueError: the agent's own bug" in lines[0]


def test_a_branching_episode_is_excluded_saying_why(served, tmp_path, caplog):
    tasks = write_tasks(tmp_path / "tasks.jsonl", sums(2))
    data = environment(served, tasks, agent="tests.environments.agents:branching")
    with pytest.raises(
        UserError, match="every episode of the step failed; the first raised: BadRequestError.*does not extend"
    ):
        data.sample(data.next_batch(1), 2, SAMPLING, seed=2)


def test_a_step_whose_every_episode_fails_stops_with_the_first_failure(served, tmp_path):
    data = environment(
        served, write_tasks(tmp_path / "tasks.jsonl", sums(2)), agent="tests.environments.agents:always_raises"
    )
    with pytest.raises(UserError, match="every episode of the step failed; the first raised: RuntimeError: no luck"):
        data.sample(data.next_batch(1), 2, SAMPLING, seed=2)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"agent": "no_colon"}, "data.agent must be `module:function`"),
        ({"agent": "no_such_module_xyz:run"}, "cannot import 'no_such_module_xyz'"),
        ({"agent": "retrain.environments.example_agent:missing"}, "has no function 'missing'"),
        ({"reward_from": "judge"}, "data.reward_from='judge'"),
        ({"timeout_s": 0}, "data.timeout_s"),
        ({"max_concurrent": 0}, "data.max_concurrent"),
        ({"tasks": ""}, "data.tasks is empty"),
        ({"reward_from": "reward", "answer_field": "solution"}, "data.answer_field='solution': no such field"),
        ({"held_out_size": 3}, "data.held_out_size=3 leaves no training task"),
    ],
)
def test_bad_settings_are_named(tmp_path, options, message):
    settings = {"tasks": write_tasks(tmp_path / "tasks.jsonl", sums(3)), "agent": EXAMPLE, **options}
    with pytest.raises(ConfigError, match=message):
        AgentEnvironment(AgentDataConfig(**settings), seed=0)


@pytest.mark.slow  # ~50 s: a 2-step run of the example agent on the tiny model, resumed for a third
def test_the_example_agent_trains_end_to_end_and_resumes(tmp_path):
    tasks = write_tasks(tmp_path / "tasks.jsonl", sums(8))
    run_dir = tmp_path / "run"

    def args(steps: int) -> list[str]:
        return [
            "data=agent",
            f"data.tasks={tasks}",
            f"data.agent={EXAMPLE}",
            "data.reward_from=reward",
            *tiny_run_args(run_dir, steps),
        ]

    result = run_cli(args(2), tmp_path)
    assert "scores their last replies" in result.stdout + result.stderr
    run_cli(args(3), tmp_path)
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [0, 1, 2]
    assert all(r["env/mean_turns"] == 2.0 and r["reward/excluded"] == 0 for r in records)
    assert "Resumed from" in (run_dir / "run.log").read_text()
    assert (run_dir / "final").is_dir()


def test_the_docs_show_the_example_agent_as_shipped():
    from tests.conftest import REPO

    shipped = (REPO / "retrain" / "environments" / "example_agent.py").read_text()
    assert f"```python\n{shipped}```" in (REPO / "docs" / "agents.md").read_text()
