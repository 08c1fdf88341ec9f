"""Inputs are checked before the model loads: config values (each error names its key), prompts
that cannot fit the model's context (named by data row), and settings that can never train (a warning)."""

from __future__ import annotations

import json
import logging
import pickle
import re
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from retrain.algorithm.checks import checked_algorithm
from retrain.assets import TINY_MODEL_DIR
from retrain.config import compose
from retrain.config_checks.validation import check_prompt_lengths, model_context, warn_if_untrainable
from retrain.errors import ConfigError, ConfigErrors, DataError, UserError
from retrain.model.spec import ChatPrompts, ModelSpec
from retrain.run import run
from retrain.types import Example
from tests.conftest import QUICK, CliHere

SHORT = [
    *(o for o in QUICK if not o.startswith("experiment=")),
    "training.max_steps=2",
]  # the quick run on any data, model
QUICK_RUN = [*QUICK, "training.max_steps=2"]
MODEL_LOADS = "Loading train model"
UNTRAINABLE = "can never train"


def raw_reward_advantage(rewards: torch.Tensor) -> torch.Tensor:
    """An advantage that is not group-relative: a group of one still carries signal."""
    return rewards - 0.5


def refused(tmp_path: Path, caplog: pytest.LogCaptureFixture, *overrides: str) -> str:
    """The message of the UserError that `run` raises for `overrides`, checked to come before any model loads."""
    with caplog.at_level(logging.INFO), pytest.raises((ConfigError, DataError)) as raised:
        run(compose([*QUICK_RUN, *overrides]), tmp_path / "run")
    assert MODEL_LOADS not in caplog.text
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    return str(raised.value)


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("training.batch_size=0", "training.batch_size must be >= 1, got 0"),
        ("training.group_size=0", "training.group_size must be >= 1, got 0"),
        ("training.max_tokens=0", "training.max_tokens must be >= 1, got 0"),
        ("training.temperature=-0.5", r"training.temperature must be >= 0 \(0 = greedy\), got -0.5"),
        ("training.top_p=0", r"training.top_p must be in \(0, 1\], got 0"),
        ("training.top_p=1.5", r"training.top_p must be in \(0, 1\], got 1.5"),
        ("eval.num_examples=-1", "eval.num_examples must be >= 0"),
        ("eval.samples=0", "eval.samples must be >= 1, got 0"),
        ("eval.every=-1", r"eval.every must be >= 0 \(0 = before and after training only\), got -1"),
        ("eval.every=5", r"eval.every=5 needs held-out problems: set eval.num_examples > 0"),
        ("training.lr=nan", "training.lr=nan is not a finite number"),
        ("training.lr=-inf", "training.lr=-inf is not a finite number"),
        ("training.betas=[0.9,nan]", r"training.betas\[1\]=nan is not a finite number"),
        ("scoring.timeout_s=inf", "scoring.timeout_s=inf is not a finite number"),
        ("algorithm.gtpo.beta=nan", "algorithm.gtpo.beta=nan is not a finite number"),
        ("+reward.scale=nan", "reward.scale=nan is not a finite number"),
        ("training.weight_decay=-1", "training.weight_decay must be >= 0"),
        ("training.save_every=-1", r"training.save_every must be >= 0 \(0 = only at the end\), got -1"),
        ("training.seed=-2", r"training.seed must be -1 \(draw a seed\) or in 0..4294967295, got -2"),
        ("training.seed=4294967296", r"training.seed must be -1 \(draw a seed\) or in 0..4294967295, got 4294967296"),
    ],
)
def test_a_bad_value_fails_naming_its_key_before_the_model_loads(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, override: str, named: str
) -> None:
    message = refused(tmp_path, caplog, override)
    assert re.search(named, message), message


def test_every_bad_value_is_named_in_one_message(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    message = refused(
        tmp_path, caplog, "training.batch_size=0", "training.lr=-1", "training.eps=0", "scoring.timeout_s=0"
    )
    assert message.startswith("4 config values cannot work: "), message
    for named in ("training.batch_size must be >= 1", "training.lr must be > 0", "training.eps must be > 0"):
        assert named in message
    assert "scoring.timeout_s must be positive" in message


def test_a_key_wrong_twice_is_named_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    message = refused(tmp_path, caplog, "training.lr=-inf", "training.seed=-2")  # -inf: not finite, and not > 0
    assert message == (
        "2 config values cannot work: training.lr=-inf is not a finite number; "
        "training.seed must be -1 (draw a seed) or in 0..4294967295, got -2"
    )


def test_the_errors_of_a_refused_config_survive_a_trip_to_another_process() -> None:
    errors = ConfigErrors(["training.lr must be > 0, got -1.0", "training.seed must be ..., got -2"])
    copied = pickle.loads(pickle.dumps(errors))  # a submitit job's error comes back pickled
    assert copied.problems == errors.problems and str(copied) == str(errors)


PRIME_RL = ["backend=prime_rl", "algorithm=maxrl_none", "backend.output_dir=/runs/prime-rl"]
TINKER = ["backend=tinker", "algorithm=maxrl_none"]
DEMO = "experiment=quickstart"
VLLM_SERVER = [
    DEMO,
    "inference=vllm_server",
    "inference.url=http://127.0.0.1:9",
]  # nothing listens: nothing may call it


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ([DEMO, "backend.micro_batch_tokens=-1"], r"backend.micro_batch_tokens=-1: must be >= 0"),
        ([DEMO, "backend.fused_elementwise=maybe"], "backend.fused_elementwise='maybe': must be one of auto, true"),
        ([*PRIME_RL, "backend.zmq_port=65535"], r"backend.zmq_port=65535: must be in 1..65534"),
        ([*PRIME_RL, "backend.strict_advantages=false"], "backend.strict_advantages=False: must stay true"),
        ([*PRIME_RL, "backend.sync_wait_s=0"], "backend.sync_wait_s=0.0: must be > 0"),
        ([*PRIME_RL, "backend.num_train_workers=0"], "backend.num_train_workers=0: must be >= 1"),
        ([*TINKER, "backend.sampler_ttl_s=60"], r"backend.sampler_ttl_s=60: must be 0 \(never expire\) or >= 3600"),
        ([*TINKER, "backend.max_retries=-1"], "backend.max_retries=-1: must be >= 0"),
        ([*TINKER, "backend.max_concurrent_calls=0"], "backend.max_concurrent_calls=0: must be >= 1"),
        ([*TINKER, "training.kl_coef=0.1"], r"training.kl_coef=0.1: backend \S+TinkerBackend has no KL to the base"),
        ([DEMO, "training.kl_coef=-1"], r"training.kl_coef must be >= 0 \(0 = no KL term\), got -1"),
        # an objective choice a remote backend does not compute: refused before training, naming the key
        ([*TINKER, "training.objective=gspo"], r"training.objective=gspo: backend \S+TinkerBackend computes only"),
        ([*PRIME_RL, "training.lr_schedule=cosine"], r"training.lr_schedule=cosine: backend \S+PrimeRlBackend"),
        ([*TINKER, "training.entropy_coef=0.01"], r"training.entropy_coef=0.01: backend \S+TinkerBackend"),
        ([*TINKER, "training.mismatch_mode=tis"], r"training.mismatch_mode=tis: backend \S+TinkerBackend"),
        ([*PRIME_RL, "training.updates_per_batch=2"], r"training.updates_per_batch=2: backend \S+PrimeRlBackend"),
        ([*TINKER, "training.mini_batches=2"], r"training.mini_batches=2: backend \S+TinkerBackend"),
        ([DEMO, "training.loss_agg=sum"], r"training.loss_agg='sum' is not one of: token_mean"),
        # the parts built after the data (scoring), or after the model too (an engine): their schemas check first
        ([DEMO, "scoring.timeout_s=0"], "scoring.timeout_s must be positive, got 0.0"),
        ([DEMO, "scoring.workers=-1"], r"scoring.workers must be 0 \(one per core\) or more, got -1"),
        ([DEMO, "model.lora_rank=0"], "model.lora_rank must be > 0, got 0"),
        ([DEMO, "model.lora_dropout=1.5"], r"model.lora_dropout must be in \[0, 1\), got 1.5"),
        ([DEMO, "inference=vllm_server"], "inference.url is empty: give the server's base url"),
        ([DEMO, "inference=sglang", "inference.url=127.0.0.1:30000"], "inference.url='127.0.0.1:30000' is not an"),
        (  # several servers: a list, or urls separated by commas; each checked as one url is
            [DEMO, "inference=sglang", "inference.url=[http://127.0.0.1:30000,127.0.0.1:30001]"],
            "inference.url='127.0.0.1:30001' is not an",
        ),
        (
            [DEMO, "inference=openai", "inference.url='http://127.0.0.1:8000,http://127.0.0.1:8000/'"],
            "inference.url names http://127.0.0.1:8000 more than once",
        ),
        ([DEMO, "inference=sglang", "inference.url=[]"], r"inference.url=\[\] is neither a url"),
        ([*VLLM_SERVER, "inference.timeout_s=0"], "inference.timeout_s must be > 0, got 0.0"),
        ([*VLLM_SERVER, "inference.max_concurrency=0"], "inference.max_concurrency must be >= 1, got 0"),
        ([DEMO, "inference=vllm", "inference.dtype=int3"], "inference.dtype='int3' is not one of"),
        ([DEMO, "inference=vllm", "inference.gpu_memory_utilization=1.5"], r"utilization must be in \(0, 1\]"),
        ([DEMO, "inference=vllm", "inference.max_model_len=-1"], "inference.max_model_len must be >= 0"),
    ],
)
def test_a_bad_part_value_fails_naming_its_key_before_data_or_a_tokenizer_loads(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, overrides: list[str], named: str
) -> None:
    with caplog.at_level(logging.INFO), pytest.raises(ConfigError) as raised:
        run(compose([*SHORT, *overrides]), tmp_path / "run")
    assert re.search(named, str(raised.value)), raised.value
    assert (
        "Loaded " not in caplog.text
    )  # refused with the config or while the parts were planned: no data, no tokenizer


def test_evaluation_on_data_without_a_held_out_split_fails_at_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "sums.jsonl"
    path.write_text("".join(json.dumps({"question": f"{n}+1", "answer": str(n + 1)}) + "\n" for n in range(8)))
    message = refused(tmp_path, caplog, "data=jsonl", f"data.path={path}", "eval.num_examples=4")
    assert "eval.num_examples=4" in message and "no held-out split" in message
    assert "set eval.num_examples=0" in message
    # the run log says which prompt template the questions go in: the default asks for a boxed answer
    assert "Prompt template (data.prompt_template, the default, asks for \\boxed{})" in caplog.text


def test_a_held_out_split_that_a_single_file_lacks_names_both_fixes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "sums.jsonl"
    path.write_text("".join(json.dumps({"question": f"{n}+1", "answer": str(n + 1)}) + "\n" for n in range(8)))
    overrides = ["data=jsonl", f"data.path={path}", "data.held_out_split=test", "eval.num_examples=4"]
    message = refused(tmp_path, caplog, *overrides, "data.prompt_template='{question}'")
    assert "data.held_out_split='test'" in message and "a single file, which is one split named 'train'" in message
    assert "set eval.num_examples=0" in message
    assert "Prompt template (data.prompt_template): '{question}'" in caplog.text


def test_a_prompt_longer_than_the_context_is_refused_naming_the_row(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rows = [{"question": "1+1", "answer": "2"}, {"question": "what is " + "1+" * 80 + "1", "answer": "81"}]
    path = tmp_path / "sums.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    message = refused(tmp_path, caplog, "data=jsonl", f"data.path={path}")
    assert "1 of 2 prompts do not fit" in message and "data row 'train/1'" in message
    assert "context of 128 tokens" in message and "training.max_tokens=8 leaves 120" in message


def test_max_tokens_that_fill_the_context_are_refused(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    message = refused(tmp_path, caplog, "training.max_tokens=128")
    assert "training.max_tokens=128 leaves no room for a prompt" in message


def test_the_lengths_are_those_of_the_chat_templated_prompts() -> None:
    model = ModelSpec(name_or_path=str(TINY_MODEL_DIR))
    tokenizer = model.load_tokenizer()
    assert model_context(model) == 128
    fits = [Example(prompt="x" * 40, reference="", id="a")]
    templated = len(ChatPrompts(tokenizer, model.name_or_path)([fits[0].prompt])[0])
    check_prompt_lengths(fits, tokenizer, model, max_tokens=128 - templated)
    with pytest.raises(DataError, match="data row 'a'"):
        check_prompt_lengths(fits, tokenizer, model, max_tokens=129 - templated)


def test_the_context_comes_from_config_json_without_weights(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"max_position_embeddings": 4096}}))
    assert model_context(ModelSpec(name_or_path=str(tmp_path))) == 4096
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "unknown"}))
    assert model_context(ModelSpec(name_or_path=str(tmp_path))) is None


@pytest.mark.parametrize(
    ("overrides", "warns"),
    [
        (["training.group_size=1"], True),
        (["training.temperature=0"], True),
        (["algorithm=rloo_gtpo_hicra", "training.group_size=1"], True),
        ([], False),
        (["training.group_size=1", f"algorithm.advantage._target_={__name__}.raw_reward_advantage"], False),
    ],
)
def test_settings_that_can_never_train_a_group_relative_advantage_warn(
    caplog: pytest.LogCaptureFixture, overrides: list[str], warns: bool
) -> None:
    cfg = compose([*QUICK_RUN, *overrides])
    with caplog.at_level(logging.WARNING):
        warn_if_untrainable(checked_algorithm(instantiate(cfg.algorithm)), OmegaConf.to_object(cfg.training))
    assert (UNTRAINABLE in caplog.text) == warns, caplog.text


def test_the_warning_comes_once_per_run(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        run(compose([*QUICK_RUN, "training.group_size=1", "training.batch_size=2", "training.max_steps=2"]), tmp_path)
    assert sum(UNTRAINABLE in message for message in caplog.messages) == 1


def test_the_command_line_says_which_key_in_one_line_and_loads_nothing(tmp_path: Path, cli_here: CliHere) -> None:
    result = cli_here([*QUICK_RUN, "training.lr=nan", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, check=False)
    console = result.stdout + result.stderr
    assert result.returncode == 1, console
    assert [line for line in console.splitlines() if line.startswith("retrain: ")] == [
        f"retrain: training.lr=nan is not a finite number (traceback in {tmp_path / 'run' / 'run.log'})"
    ]
    assert MODEL_LOADS not in console and "Traceback" not in console


def test_a_rewards_mistake_is_reported_before_the_data_loads(tmp_path: Path, cli_here: CliHere) -> None:
    """The reward is built first (a data set may take minutes to download): its own checks, then its workers."""
    run_dir = tmp_path / "run"
    result = cli_here(
        [*QUICK_RUN, "reward=judge", "reward.base_url=localhost:8000", f"hydra.run.dir={run_dir}"],
        tmp_path,
        check=False,
    )
    console = result.stdout + result.stderr
    assert result.returncode == 1 and "retrain: reward.base_url must be an http(s) URL, got 'localhost:8000'" in console
    assert "Loaded " not in console, console


def test_a_dead_inference_server_is_found_before_data_or_the_model_loads(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO), pytest.raises(UserError) as raised:
        run(compose([*QUICK, *VLLM_SERVER[1:], "inference.max_retries=0"]), tmp_path / "run")
    assert str(raised.value).startswith("inference.url: no server answers (GET http://127.0.0.1:9/: Connect")
    assert "Loaded " not in caplog.text and MODEL_LOADS not in caplog.text
