"""End to end through the real CLI, the tiny model, real files on disk: `python -m retrain` in a process of
its own where the process matters (reproducibility, a kill, the run-dir contract, settings read at import),
its entry point in the test's process elsewhere (`cli_here`, without 5-7 s of imports per run)."""

from __future__ import annotations

import functools
import json
import shutil
import time
from pathlib import Path

import pytest

from retrain.assets import TINY_MODEL_DIR
from tests.conftest import CliHere, read_metrics, run_cli, sigkill_once_checkpointed, without_timing
from tests.wandb_records import offline_history

SMALL = ["experiment=quickstart", "eval.num_examples=0", "logging.progress_bar=false"]


DEFAULT_THREADS = functools.partial(run_cli, one_thread=False)  # as users run (docs/reproducibility.md)


def small_run(tmp_path: Path, name: str, *extra: str, steps: int = 4, cli: CliHere = run_cli) -> Path:
    run_dir = tmp_path / name
    cli([*SMALL, f"training.max_steps={steps}", f"hydra.run.dir={run_dir}", *extra], cwd=tmp_path)
    return run_dir


def test_quickstart_writes_the_run_dir_contract(tmp_path: Path, cli_here: CliHere) -> None:
    run_dir = small_run(tmp_path, "run", "training.save_every=2", cli=cli_here)
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    for key in [
        "step",
        "condition",
        "loss",
        "mean_reward",
        "correct_rate",
        "running_correct_rate",
        "num_datums",
        "max_token_hit_rate",
        "step_time_s",
        "batch_size",
        "group_size",
        "sepa_lambda",
        "reward/errors",
    ]:
        assert key in records[0], key
    assert records[0]["batch_size"] == 8 and records[0]["group_size"] == 8
    assert (run_dir / "emergence" / "steps.jsonl").is_file()
    assert (run_dir / "emergence" / "generations.jsonl").is_file()
    assert (run_dir / ".hydra" / "config.yaml").is_file() and (run_dir / "run.log").is_file()
    for checkpoint in ["checkpoints/step_2", "checkpoints/step_4", "final"]:
        assert (run_dir / checkpoint / "adapter_model.safetensors").is_file(), checkpoint
        assert (run_dir / checkpoint / "trainer_state.json").is_file(), checkpoint
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "done" and status["step"] == 3
    assert "Step 3 [" in (run_dir / "run.log").read_text()


def test_kl_to_the_base_model_is_logged_when_its_coefficient_is_set(tmp_path: Path, cli_here: CliHere) -> None:
    records = read_metrics(small_run(tmp_path, "kl", "training.seed=3", "training.kl_coef=0.05", steps=2, cli=cli_here))
    assert [record["num_tokens"] > 0 for record in records] == [True, True]
    assert records[0]["policy/kl"] == pytest.approx(0.0, abs=1e-7)  # the adapter starts at zero: the base model
    assert records[1]["policy/kl"] > 0  # after one update


def test_same_seed_gives_identical_metrics(tmp_path: Path) -> None:
    """With the default thread count, as users run (docs/reproducibility.md)."""
    first = without_timing(read_metrics(small_run(tmp_path, "a", "training.seed=7", cli=DEFAULT_THREADS)))
    second = without_timing(read_metrics(small_run(tmp_path, "b", "training.seed=7", cli=DEFAULT_THREADS)))
    other = without_timing(read_metrics(small_run(tmp_path, "c", "training.seed=8", cli=DEFAULT_THREADS)))
    assert first == second
    assert first != other


@pytest.mark.slow
def test_sigkill_then_resume_gives_identical_metrics(tmp_path: Path) -> None:
    """With the default thread count, as users run (docs/reproducibility.md)."""
    steps = 6
    reference = without_timing(
        read_metrics(small_run(tmp_path, "full", "training.save_every=1", steps=steps, cli=DEFAULT_THREADS))
    )

    run_dir = tmp_path / "killed"
    args = [*SMALL, f"training.max_steps={steps}", "training.save_every=1", f"hydra.run.dir={run_dir}"]
    sigkill_once_checkpointed(args, tmp_path, run_dir / "checkpoints" / "step_3")
    assert not (run_dir / "final").exists(), "the run finished before it could be killed"

    # same run dir, no resume flag: a requeued job resumes by itself
    DEFAULT_THREADS(args, cwd=tmp_path)
    assert without_timing(read_metrics(run_dir)) == reference

    # explicit resume.from=<run dir> into a new run dir continues the same trajectory too
    partial = tmp_path / "partial"
    small_run(tmp_path, "partial", "training.save_every=1", steps=3, cli=DEFAULT_THREADS)
    resumed = small_run(
        tmp_path, "resumed", "training.save_every=1", f"resume.from={partial}", steps=steps, cli=DEFAULT_THREADS
    )
    assert without_timing(read_metrics(resumed)) == reference


@pytest.mark.slow
def test_a_learning_rate_schedule_resumes_exactly_after_a_sigkill(tmp_path: Path) -> None:
    """The scheduler's state is in every checkpoint: killed after step 2 and rerun, a warmup + cosine run logs the
    uninterrupted run's rates and metrics."""
    schedule = ["training.seed=3", "training.save_every=1", "training.lr_schedule=cosine", "training.warmup_steps=1"]
    steps = 4
    reference = without_timing(read_metrics(small_run(tmp_path, "full", *schedule, steps=steps, cli=DEFAULT_THREADS)))
    # warmup from 0, then cosine from the quickstart's 1e-3 over the remaining 3 steps: cos(0), cos(π/3), cos(2π/3)
    assert [record["optim/lr"] for record in reference] == pytest.approx([0.0, 1e-3, 7.5e-4, 2.5e-4])

    run_dir = tmp_path / "killed"
    args = [*SMALL, f"training.max_steps={steps}", *schedule, f"hydra.run.dir={run_dir}"]
    sigkill_once_checkpointed(args, tmp_path, run_dir / "checkpoints" / "step_2")
    assert not (run_dir / "final").exists(), "the run finished before it could be killed"
    DEFAULT_THREADS(args, cwd=tmp_path)
    assert without_timing(read_metrics(run_dir)) == reference


def test_resuming_a_finished_run_is_a_clear_no_op(tmp_path: Path, cli_here: CliHere) -> None:
    run_dir = small_run(tmp_path, "done", steps=2, cli=cli_here)
    before = read_metrics(run_dir)
    out = cli_here([*SMALL, "training.max_steps=2", f"hydra.run.dir={run_dir}"], cwd=tmp_path).stdout
    assert "already finished" in out
    assert read_metrics(run_dir) == before


def test_a_run_dir_holding_a_different_run_is_not_silently_reused(tmp_path: Path, cli_here: CliHere) -> None:
    run_dir = small_run(tmp_path, "taken", steps=1, cli=cli_here)
    result = cli_here(
        [*SMALL, "training.max_steps=2", "training.lr=0.002", f"hydra.run.dir={run_dir}"], cwd=tmp_path, check=False
    )
    assert result.returncode != 0
    assert "different config" in result.stdout and "training.lr" in result.stdout
    assert len(read_metrics(run_dir)) == 1


def test_a_bf16_run_on_cpu_passes_the_freshness_proof(tmp_path: Path, cli_here: CliHere) -> None:
    """This seed's first sync once failed the proof in bf16 ("serves stale weights") with a fresh engine."""
    run_dir = small_run(
        tmp_path, "bf16", "model.dtype=bf16", "algorithm=grpo_none", "training.seed=1", steps=3, cli=cli_here
    )
    proven = [record["engine/probe_gap"] for record in read_metrics(run_dir) if "engine/probe_gap" in record]
    assert proven and max(proven) == 0.0  # engine and trainer run the same bf16 forward on the same weights


def test_custom_reward_plugin_from_the_command_line(tmp_path: Path, cli_here: CliHere) -> None:
    run_dir = small_run(
        tmp_path, "plugin", "reward._target_=tests.plugins.training_plugins.digit_count_reward", steps=2, cli=cli_here
    )
    records = read_metrics(run_dir)
    assert len(records) == 2 and records[0]["reward/errors"] == 0
    assert 0.0 < records[0]["mean_reward"] < 1.0


def test_a_crashing_reward_is_counted_and_survived(tmp_path: Path, cli_here: CliHere) -> None:
    run_dir = small_run(
        tmp_path, "crash", "reward._target_=tests.plugins.training_plugins.flaky_reward", steps=2, cli=cli_here
    )
    records = read_metrics(run_dir)
    assert len(records) == 2
    assert all(r["reward/errors"] > 0 for r in records)


def test_wandb_offline_run_holds_the_metrics(tmp_path: Path) -> None:
    run_dir = tmp_path / "wandb"
    run_cli(
        [*SMALL, "training.max_steps=2", f"hydra.run.dir={run_dir}", "logging.wandb_project=retrain-test"],
        cwd=tmp_path,
        env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"},
    )
    run_files = list(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(run_files) == 1, "no offline wandb run was written"
    history = offline_history(run_files[0])
    metrics = read_metrics(run_dir)
    assert [h["_step"] for h in history] == [0, 1]
    for logged, record in zip(history, metrics):
        assert logged["train/correct_rate"] == pytest.approx(record["correct_rate"])
        assert logged["train/loss"] == pytest.approx(record["loss"])
        assert logged["train/reward/errors"] == record["reward/errors"]
        assert any(key.startswith("train/surprisal/") for key in logged)


def long_context_tiny_model(tmp_path: Path) -> Path:
    """The tiny model in a local dir, with a context that GSM8K and MATH prompts fit (its own 128
    positions fit the arithmetic task only; RoPE learns no positions, so the same weights serve more)."""
    copy = tmp_path / "tiny_long_context"
    shutil.copytree(TINY_MODEL_DIR, copy)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 4096}))
    return copy


def test_local_model_dir_and_data_files_work_like_hub_ids(tmp_path: Path, shared_data: Path, cli_here: CliHere) -> None:
    model = f"model.name_or_path={long_context_tiny_model(tmp_path)}"
    gsm8k = small_run(
        tmp_path,
        "gsm8k",
        "data=gsm8k",
        f"data.path={shared_data / 'gsm8k' / 'test.jsonl'}",
        model,
        steps=1,
        cli=cli_here,
    )
    assert read_metrics(gsm8k)[0]["step"] == 0
    math500 = small_run(
        tmp_path,
        "math",
        "data=math",
        f"data.path={shared_data / 'math' / 'test.jsonl'}",
        model,
        "reward=math",
        steps=1,
        cli=cli_here,
    )
    record = read_metrics(math500)[0]
    assert record["step"] == 0 and record["reward/errors"] == 0
    generation = json.loads((math500 / "emergence" / "generations.jsonl").read_text().splitlines()[0])
    assert generation["example_id"].startswith("test/")  # a MATH-500 problem, e.g. test/algebra/1.json


def test_evaluation_without_held_out_problems_fails_before_the_model_loads(tmp_path: Path, cli_here: CliHere) -> None:
    result = cli_here(
        [
            *SMALL,
            "training.max_steps=1",
            "eval.num_examples=4",
            "data.held_out_size=0",
            f"hydra.run.dir={tmp_path / 'no_held_out'}",
        ],
        cwd=tmp_path,
        check=False,
    )
    assert result.returncode != 0
    assert "eval.num_examples=4" in result.stdout and "data.held_out_size" in result.stdout
    assert "Loading train model" not in result.stdout + result.stderr
    assert not (tmp_path / "no_held_out" / "metrics.jsonl").exists()


def test_default_run_offline_fails_fast_and_points_at_quickstart(tmp_path: Path) -> None:
    started = time.time()
    result = run_cli(
        ["training.max_steps=1", f"hydra.run.dir={tmp_path / 'default'}"],
        cwd=tmp_path,
        check=False,
        timeout=120,
        env={"HF_HUB_OFFLINE": "0"},
    )
    assert result.returncode != 0
    message = result.stdout + result.stderr
    assert "experiment=quickstart" in message
    assert "hendrycks_math" in message or "Qwen/Qwen3-4B-Instruct-2507" in message
    assert time.time() - started < 60


@pytest.mark.slow
def test_quickstart_learns(tmp_path: Path) -> None:
    """The embedded default: held-out sampled accuracy rises by >= 15 points on CPU."""
    run_dir = tmp_path / "quickstart"
    run_cli(["experiment=quickstart", f"hydra.run.dir={run_dir}", "logging.progress_bar=false"], cwd=tmp_path)
    evaluation = json.loads((run_dir / "status.json").read_text())["eval"]
    gain = evaluation["eval/after_sampled_accuracy"] - evaluation["eval/before_sampled_accuracy"]
    assert gain >= 0.15, evaluation
