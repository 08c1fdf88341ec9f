"""data=verifiers on the real verifiers 0.4 and the tiny model: config errors, rows and masks of multi-turn
episodes (environment tokens never trained), and end-to-end runs that train and resume."""

from __future__ import annotations

import json

import pytest
import torch

from retrain.environments.config import VerifiersDataConfig
from retrain.environments.verifiers_env import VerifiersEnvironment, parse_args
from retrain.errors import ConfigError
from retrain.inference.endpoint import EngineEndpoint
from retrain.types import SamplingParams, TrainBatch
from tests.backend.tiny_model import make_backend, make_engine, tokenizer_of
from tests.conftest import read_metrics, run_cli
from tests.environments.conftest import ENVS, tiny_run_args

RETRY = "Wrong, try again."
JSON_ARGS = """data.args='{"num_tasks": 12}'"""  # a JSON string, quoted for Hydra


def test_args_take_a_mapping_or_a_json_string():
    assert parse_args({"split": "train"}) == {"split": "train"}
    assert parse_args('{"num_tasks": 3}') == {"num_tasks": 3}
    with pytest.raises(ConfigError, match="data.args is not valid JSON"):
        parse_args("{num_tasks: 3")
    with pytest.raises(ConfigError, match="data.args must be a mapping"):
        parse_args("[1, 2]")


def test_an_environment_without_training_tasks_fails_naming_it(test_envs):
    with pytest.raises(ConfigError, match="'retrain_arith_single' has no training tasks"):
        VerifiersEnvironment(VerifiersDataConfig(id="retrain_arith_single", args='{"split": "eval"}'), seed=0)


def test_a_missing_environment_says_how_to_install_it():
    with pytest.raises(ConfigError, match="not installed.*prime env install owner/no_such_env.*data.auto_install"):
        VerifiersEnvironment(VerifiersDataConfig(id="owner/no_such_env"), seed=0)


def test_unknown_args_name_data_args(test_envs):
    with pytest.raises(ConfigError, match="data.args do not fit environment 'retrain_arith_single'"):
        VerifiersEnvironment(VerifiersDataConfig(id="retrain_arith_single", args={"num_tasks": "many"}), seed=0)


@pytest.mark.slow  # ~20 s: 32 episodes on the tiny model
def test_multi_turn_rows_train_only_the_model_tokens(test_envs, tiny_spec):
    backend = make_backend(tiny_spec)
    tokenizer = tokenizer_of(tiny_spec.name_or_path)
    environment = VerifiersEnvironment(
        VerifiersDataConfig(id="retrain_arith_multi", args={"num_tasks": 8}, max_turns=3), seed=0
    )
    endpoint = EngineEndpoint(make_engine(backend))
    try:
        environment.connect(endpoint, tokenizer, tiny_spec.source()[0])
        examples = environment.next_batch(4)
        sampling = SamplingParams(max_tokens=8, temperature=1.0)
        scored = environment.sample(examples, 4, sampling, seed=5)
        again = environment.sample(examples, 4, sampling, seed=5)
    finally:
        endpoint.close()
    rollouts = scored.rollouts
    assert torch.equal(rollouts.completion_ids, again.rollouts.completion_ids)  # seeded: the same episodes
    retry_ids = tokenizer.encode(RETRY, add_special_tokens=False)
    multi_turn = [n for n, text in enumerate(rollouts.texts) if RETRY in text]
    assert multi_turn, "no episode got the environment's second turn"
    for n in multi_turn:
        ids = rollouts.completion_ids[n].tolist()
        start = next(i for i in range(len(ids)) if ids[i : i + len(retry_ids)] == retry_ids)
        span = slice(start, start + len(retry_ids))
        assert not rollouts.sampled_mask[n, span].any()  # the environment's words are context, not samples
        assert rollouts.completion_mask[n, span].all()
        assert (rollouts.logprobs[n, span] == 0).all()
        assert rollouts.sampled_mask[n, :start].any() and rollouts.sampled_mask[n, start:].any()  # both model turns
    for n, text in enumerate(rollouts.texts):  # the rubric's reward: the last reply's boxed answer
        last = text.rsplit("assistant\n", 1)[-1]
        assert float(scored.rewards.view(-1)[n]) == float(last.strip() == f"\\boxed{{{examples[n // 4].reference}}}")
    assert not scored.excluded.any()
    assert (rollouts.logprobs[rollouts.sampled_mask] < 0).all()

    advantages = torch.where(rollouts.trained_mask, 1.0, 0.0)  # every row, every token: only sampled ones may train
    result = backend.train(TrainBatch(rollouts, advantages, torch.ones(rollouts.num_rows, dtype=torch.bool)))
    assert result.num_tokens == int(rollouts.trained_mask.sum()) < int(rollouts.completion_mask.sum())


@pytest.mark.slow  # ~25 s: 2 x 16 multi-turn episodes on the tiny model
def test_a_second_environment_in_the_process_samples_and_a_branching_episode_is_excluded(test_envs, tiny_spec, caplog):
    """Two environments one after the other in one process (an in-process sweep's jobs), each on its own endpoint,
    16 episodes at once: verifiers' renderers bind a module-level lock to the event loop of the first step that
    waits on it, so the second environment's episodes failed on it when each step had a loop of its own.
    The second step, seed 11, has an episode with two trainable branches (verifiers splits a trace whose later
    turn does not extend the earlier tokens): it is excluded and counted, and the step keeps the others."""
    backend = make_backend(tiny_spec)
    tokenizer = tokenizer_of(tiny_spec.name_or_path)
    results = []
    for seed in (5, 11):
        environment = VerifiersEnvironment(
            VerifiersDataConfig(id="retrain_arith_multi", args={"num_tasks": 8}, max_turns=3), seed=0
        )
        endpoint = EngineEndpoint(make_engine(backend))
        try:
            environment.connect(endpoint, tokenizer, tiny_spec.source()[0])
            with caplog.at_level("WARNING", logger="retrain.environments.verifiers_env"):
                results.append(environment.sample(environment.next_batch(4), 4, SamplingParams(max_tokens=8), seed))
        finally:
            endpoint.close()
    assert not results[0].excluded.any()
    excluded = int(results[1].excluded.sum())
    assert 0 < excluded < 16 and results[1].errors == excluded
    assert (
        f"{excluded}/16 episodes excluded (0 failed, {excluded} branched); the first: 2 trainable branches"
        in caplog.text
    )
    assert "different event loop" not in caplog.text


@pytest.mark.slow  # ~30 s: 2 x 16 multi-turn episodes on the tiny model
def test_episodes_sampled_together_are_those_sampled_one_at_a_time(test_envs, tiny_spec):
    """max_concurrent 1 (one request at a time) and 16 (the requests of 16 episodes in shared engine batches) give the
    same rollouts: a request's tokens depend on its own seed and positions, not on which requests share its batch."""
    backend = make_backend(tiny_spec)
    tokenizer = tokenizer_of(tiny_spec.name_or_path)
    sampling = SamplingParams(max_tokens=8, temperature=1.0)
    endpoint = EngineEndpoint(make_engine(backend))
    results = []
    try:
        for max_concurrent in (1, 16):
            environment = VerifiersEnvironment(
                VerifiersDataConfig(
                    id="retrain_arith_multi", args={"num_tasks": 8}, max_turns=3, max_concurrent=max_concurrent
                ),
                seed=0,
            )
            environment.connect(endpoint, tokenizer, tiny_spec.source()[0])
            results.append(environment.sample(environment.next_batch(4), 4, sampling, seed=5))
            if max_concurrent == 1:
                assert endpoint.batcher.most_in_flight == 1
    finally:
        endpoint.close()
    assert endpoint.batcher.most_in_flight > 1
    one, many = (scored.rollouts for scored in results)
    assert torch.equal(one.completion_ids, many.completion_ids)
    assert torch.equal(one.sampled_mask, many.sampled_mask)
    # the same tokens; their log-probs within fp32 rounding of matmuls over other row counts (1.04e-5 on CI's CPU
    # at a log-prob of -0.76), the tolerance the engine's own batching tests use (tests/inference/test_kv_budget.py)
    torch.testing.assert_close(one.logprobs, many.logprobs, rtol=1e-5, atol=5e-5)
    assert torch.equal(results[0].rewards, results[1].rewards)


def run_args(env_id: str, run_dir, steps: int, *extra: str) -> list[str]:
    return ["data=verifiers", f"data.id={env_id}", *tiny_run_args(run_dir, steps), *extra]


def env_path() -> dict[str, str]:
    from tests.conftest import cli_env

    return {"PYTHONPATH": f"{ENVS}:{cli_env()['PYTHONPATH']}"}


@pytest.mark.slow
def test_single_turn_environment_trains_and_resumes(tmp_path):
    run_dir = tmp_path / "run"
    first = run_cli(run_args("retrain_arith_single", run_dir, 2, JSON_ARGS), tmp_path, env=env_path())
    assert "reward=retrain.reward.match.match_reward is not used" in first.stdout + first.stderr
    run_cli(run_args("retrain_arith_single", run_dir, 3, JSON_ARGS), tmp_path, env=env_path())
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [0, 1, 2]
    assert all(r["env/mean_turns"] == 1.0 for r in records)
    assert any(r["num_datums"] > 0 for r in records)  # the rubric's rewards varied within a group and it trained
    assert "Resumed from" in (run_dir / "run.log").read_text()
    generations = [json.loads(line) for line in (run_dir / "emergence" / "generations.jsonl").read_text().splitlines()]
    for row in generations:
        assert row["reward"] == float(row["completion"].strip() == f"\\boxed{{{row['reference']}}}")


@pytest.mark.slow
def test_multi_turn_environment_trains(tmp_path):
    run_dir = tmp_path / "run"
    run_cli(run_args("retrain_arith_multi", run_dir, 2, "data.max_turns=2"), tmp_path, env=env_path())
    records = read_metrics(run_dir)
    assert len(records) == 2 and all(1.0 <= r["env/mean_turns"] <= 2.0 for r in records)
    assert (run_dir / "final").is_dir()
