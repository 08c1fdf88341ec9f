"""`retrain explain`: the real command in a subprocess (loading no model), and the estimate's formulas."""

from __future__ import annotations

import json
import math
from dataclasses import fields
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from retrain.campaign.manifest import CampaignSettings, collect, start_manifest
from retrain.campaign.plan import expand
from retrain.campaign.summary import build_summary
from retrain.commands.capacity import (
    CPU_REFERENCE_STEP_S,
    REFERENCE_STEP_S,
    Workload,
    model_params,
    read_pilot,
    step_time,
    wall_hours,
)
from retrain.commands.explain import launcher_parallelism
from retrain.commands.explain import main as explain_main
from retrain.config import TrainingConfig, compose
from retrain.errors import ConfigError
from retrain.model.config_files import params_from_config
from tests.conftest import CliHere, run_cli

# Qwen3-4B's config.json (the architecture fields the parameter count reads)
QWEN3_4B = {
    "hidden_size": 2560,
    "num_hidden_layers": 36,
    "intermediate_size": 9728,
    "vocab_size": 151936,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "tie_word_embeddings": True,
}


def explain(tmp_path: Path, *args: str, check: bool = True) -> dict:
    # offline with an empty Hugging Face cache: reading the model or its tokenizer would fail the command
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    result = run_cli(["explain", "--json", *args], cwd=tmp_path, env=env, check=check, timeout=300)
    return {"returncode": result.returncode, "stderr": result.stderr, **json.loads(result.stdout)}


def test_the_default_run_explained_without_loading_a_model(tmp_path: Path) -> None:
    report = explain(tmp_path, "--gpu", "h100")
    [condition] = report["conditions"]
    assert (condition["name"], condition["label"], condition["runs"]) == ("maxrl_gtpo_sepa", "maxrl+gtpo_sepa", 1)
    parts = condition["parts"]
    assert parts["backend"] == {
        "option": "local",
        "_target_": "retrain.backend.local.LocalBackend",
        "targets": {"backend": "retrain.backend.local.LocalBackend"},
    }
    assert parts["algorithm"]["targets"]["algorithm.transforms.sepa"] == "retrain.algorithm.transforms.SEPAPooling"
    assert parts["data"]["_target_"] == "retrain.data.math.MathData"
    backend = condition["backend"]
    assert backend["source"] == "builtin" and backend["capabilities"]["preserves_token_advantages"] is True
    assert condition["preflight"]["ok"] and condition["preflight"]["token_varying"]
    assert condition["planning_detection"] and condition["sepa"]
    [run] = report["runs"]
    assert run["run_dir"].startswith("outputs/runs/") and run["run_dir"].endswith("_maxrl_gtpo_sepa")
    assert run["wandb"]["enabled"] is False
    # the reference: 15 s for 4 × 8 completions of 10,240 tokens of a 4B model; the default is 8 × 16 of those
    assert run["workload"]["params_source"] == "name" and run["workload"]["gpus"] == 1
    assert run["estimate"]["step_time_s"] == pytest.approx(15.0 * 4)
    # start-up, the 4B model's bf16 weights read at 1 GB/s, 500 steps; no evaluation (eval.num_examples=0)
    assert (run["estimate"]["startup_s"], run["estimate"]["model_load_s"], run["estimate"]["eval_s"]) == (10.0, 8.0, 0)
    assert report["estimate"]["wall_hours"] == pytest.approx((10 + 8 + 60.0 * 500) / 3600)
    assert report["estimate"]["gpu_hours"] == pytest.approx((10 + 8 + 60.0 * 500) / 3600)
    assert not (tmp_path / "outputs").exists()  # a dry run writes nothing


@pytest.mark.slow
def test_a_campaign_is_planned_in_hydras_order_with_its_run_dirs_groups_and_wall_time(tmp_path: Path) -> None:
    # the command line's sweep of `algorithm` replaces the preset's five conditions (docs/campaigns.md)
    report = explain(
        tmp_path,
        "-m",
        "+campaign=ablation",
        "algorithm=grpo_none,maxrl_gtpo_sepa",
        "training.seed=1,2,3",
        "hydra/launcher=slurm",
        "--gpu",
        "a100",
    )
    runs = report["runs"]
    assert [(r["num"], r["condition"], r["seed"]) for r in runs] == [
        (num, condition, seed)
        for num, (condition, seed) in enumerate((c, s) for c in ("grpo_none", "maxrl_gtpo_sepa") for s in (1, 2, 3))
    ]
    sweep_dir = Path(report["sweep_dir"])
    for run in runs:
        assert Path(run["run_dir"]) == sweep_dir / f"{run['condition']}_s{run['seed']}"
        assert run["wandb"]["group"] == run["condition"]
        assert run["wandb"]["name"] == f"{run['condition']}_s{run['seed']}"
    grpo, sepa = report["conditions"]
    assert (grpo["name"], grpo["runs"], grpo["sepa"], grpo["planning_detection"]) == ("grpo_none", 3, False, False)
    assert grpo["preflight"]["token_varying"] is False
    assert (sepa["name"], sepa["sepa"], sepa["planning_detection"]) == ("maxrl_gtpo_sepa", True, True)
    # 6 runs of 500 steps at 4 × 25 s; the SLURM launcher runs up to array_parallelism=8 at once: one wave
    run_hours = (10 + 8 + REFERENCE_STEP_S["a100"] * 4 * 500) / 3600  # start-up and model load included
    estimate = report["estimate"]
    assert (estimate["launcher"], estimate["parallel_runs"]) == ("SlurmLauncher", 6)
    assert estimate["wall_hours"] == pytest.approx(run_hours)
    assert estimate["gpu_hours"] == pytest.approx(6 * run_hours)


def test_the_basic_launcher_runs_one_job_at_a_time() -> None:
    assert launcher_parallelism(compose([], return_hydra_config=True), 40) == ("BasicLauncher", 1)
    slurm = compose(["hydra/launcher=slurm"], return_hydra_config=True)
    assert launcher_parallelism(slurm, 40) == ("SlurmLauncher", 8)


@pytest.mark.slow
def test_a_pilot_run_replaces_the_reference(tmp_path: Path) -> None:
    pilot = tmp_path / "pilot"
    (pilot / ".hydra").mkdir(parents=True)
    (pilot / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(compose(["experiment=quickstart"])))
    (pilot / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": i, "step_time_s": t}) + "\n" for i, t in enumerate([3.0, 1.0, 2.0, 10.0]))
    )
    report = explain(tmp_path, "experiment=quickstart", "training.batch_size=16", "--pilot", str(pilot))
    # median 2.5 s, doubled: the planned run samples twice the pilot's completions per step
    assert report["estimate"]["pilot"]["median_step_time_s"] == 2.5
    assert report["runs"][0]["estimate"]["step_time_s"] == pytest.approx(5.0)
    assert report["runs"][0]["estimate"]["source"] == f"pilot:{pilot}"
    # and the held-out evaluation before and after: 200 problems × (greedy + 4 sampled), at 5 s per 16 × 8
    evaluation = 2 * 200 * 5 * 5.0 / (16 * 8)
    assert report["runs"][0]["estimate"]["eval_s"] == pytest.approx(evaluation)
    load = report["runs"][0]["estimate"]["model_load_s"]
    assert report["estimate"]["wall_hours"] == pytest.approx((10 + load + 5.0 * 150 + evaluation) / 3600)
    assert report["estimate"]["gpu_hours"] == 0  # on the CPU


def test_a_pilot_that_is_no_run_dir_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="pilot .*nowhere: not a run dir \\(no metrics.jsonl there\\)"):
        read_pilot(tmp_path / "nowhere")
    (tmp_path / "sweep").mkdir()
    (tmp_path / "sweep" / "manifest.json").write_text("{}")
    with pytest.raises(ConfigError, match="sweep: a sweep dir: give one of its run dirs"):
        read_pilot(tmp_path / "sweep")


def test_a_failing_preflight_exits_1_with_its_message(tmp_path: Path, cli_here: CliHere) -> None:
    backend = "tests.plugins.training_plugins.ScalarAdvantageBackend"
    result = cli_here(
        ["explain", f"backend._target_={backend}", "algorithm=maxrl_gtpo_sepa"], cwd=tmp_path, check=False
    )
    assert result.returncode == 1
    assert "preflight: FAILED" in result.stdout and f"backend {backend} (source=plugin/hook)" in result.stdout
    assert f"preflight failed: algorithm 'maxrl_gtpo_sepa' cannot run on backend '{backend}'" in result.stderr
    assert "preserves_token_advantages=false" in result.stderr


def test_bad_overrides_fail_naming_the_key(capsys: pytest.CaptureFixture[str]) -> None:
    assert explain_main(["+training.lrr=1"]) == 1
    assert "unknown config key 'training.lrr'" in capsys.readouterr().err
    assert explain_main(["algorithm=grpo_none,maxrl_none"]) == 1
    assert "add -m (--multirun)" in capsys.readouterr().err
    assert explain_main(["-m", "training.lr=interval(0.1,1)"]) == 1
    assert "the basic sweeper sweeps only" in capsys.readouterr().err
    assert explain_main(["inference=vllm_server"]) == 1  # a value the engine's schema refuses
    assert "inference.url is empty" in capsys.readouterr().err
    assert explain_main(["training.lrr=1"]) == 1  # Hydra's compose error, as the run reports it
    known = ", ".join(sorted(field.name for field in fields(TrainingConfig)))
    assert capsys.readouterr().err == (
        f"retrain explain: unknown config key 'training.lrr'; did you mean 'training.lr'? (known: {known})\n"
    )


@pytest.mark.parametrize(
    ("arguments", "line"),
    [
        (
            ["hydra.run.dir=${nosuch}"],
            "hydra.run.dir: its interpolation cannot be resolved: Interpolation key 'nosuch'",
        ),
        (
            ["-m", "hydra.sweep.dir=/x/${oc.env:RETRAIN_TEST_UNSET}"],
            "hydra.sweep.dir: its interpolation cannot be resolved: Environment variable 'RETRAIN_TEST_UNSET' not found",
        ),
        (["-m", "hydra.sweep.subdir=${training.seedd}"], "hydra.sweep.subdir: its interpolation cannot be resolved: "),
    ],
)
def test_a_run_dir_the_run_could_not_resolve_either_is_named(
    arguments: list[str], line: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert explain_main(arguments) == 1
    assert capsys.readouterr().err.startswith(f"retrain explain: {line}")


def test_a_run_dir_that_only_the_launcher_can_resolve_is_shown_as_written(capsys: pytest.CaptureFixture[str]) -> None:
    subdir = "hydra.sweep.subdir=${hydra:job.num}_${hydra.job.num}"
    assert explain_main(["--json", "-m", "training.seed=1,2", subdir]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [run["run_dir"].endswith("/${hydra:job.num}_${hydra.job.num}") for run in report["runs"]] == [True, True]


# ---- the estimate's formulas (docs/capacity-planning.md) ----------------------------------------------


def test_parameter_count_without_loading_the_model() -> None:
    assert params_from_config(QWEN3_4B) == pytest.approx(4.02e9, rel=1e-3)
    assert params_from_config({"hidden_size": 8}) is None
    assert model_params("meta-llama/Llama-3.1-8B") == (8e9, "name")
    assert model_params("Qwen/Qwen3-0.6B") == (0.6e9, "name")
    assert model_params("HuggingFaceTB/SmolLM-135M") == (135e6, "name")
    params, source = model_params("retrain:tiny_qwen3")  # the bundled model's own config.json
    assert source == "config.json" and params is not None and 1e5 < params < 1e7


def test_reference_step_time_scales_with_the_workload() -> None:
    reference = Workload(completions=32, max_tokens=10240, params=4e9, params_source="name", gpus=1, remote=False)
    assert step_time(reference, "rtx4090").seconds == 45.0
    bigger = Workload(completions=64, max_tokens=5120, params=8e9, params_source="name", gpus=2, remote=False)
    assert step_time(bigger, "h100").seconds == pytest.approx(15.0 * 2 * 0.5 * 2)
    remote = Workload(completions=32, max_tokens=10240, params=4e9, params_source="name", gpus=0, remote=True)
    assert step_time(remote, "h100").seconds == pytest.approx(17.0)
    cpu = Workload(completions=32, max_tokens=10240, params=4e9, params_source="name", gpus=0, remote=False)
    # the CPU row: the quickstart's step, scaled up (never down: its fixed per-step costs dominate)
    assert step_time(cpu, "h100").seconds == pytest.approx(
        CPU_REFERENCE_STEP_S * (32 / 64) * (10240 / 8) * (4e9 / 898_944)
    )
    quickstart = Workload(completions=64, max_tokens=8, params=898_944, params_source="name", gpus=0, remote=False)
    tinier = Workload(completions=8, max_tokens=4, params=898_944, params_source="name", gpus=0, remote=False)
    assert step_time(quickstart).seconds == step_time(tinier).seconds == CPU_REFERENCE_STEP_S
    assert step_time(quickstart).source == "reference:cpu"


def test_a_cpu_run_is_estimated_without_a_pilot_with_start_up_load_and_evaluation(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert explain_main(["--json", "experiment=quickstart"]) == 0
    [run] = json.loads(capsys.readouterr().out)["runs"]
    estimate = run["estimate"]
    step = CPU_REFERENCE_STEP_S
    assert (estimate["step_time_s"], estimate["source"]) == (step, "reference:cpu")
    assert estimate["eval_s"] == pytest.approx(2 * 200 * 5 * step / 64)  # before and after: 200 × (1 + 4)
    parts = estimate["startup_s"] + estimate["model_load_s"] + estimate["training_s"] + estimate["eval_s"]
    assert estimate["training_s"] == pytest.approx(step * 150) and estimate["hours"] == pytest.approx(parts / 3600)
    assert 16 <= estimate["hours"] * 3600 < 60  # measured: 16-18 s on a quiet 2-core machine (docs/benchmarks.md)


def test_wall_time_fills_parallel_slots_in_order() -> None:
    assert wall_hours([1.0] * 5, 1) == 5.0
    assert wall_hours([1.0] * 5, 2) == 3.0
    assert wall_hours([3.0, 1.0, 1.0, 1.0], 2) == 3.0
    assert math.isclose(wall_hours([1.0] * 40, 8), 5.0)


def test_explain_names_a_sweeps_conditions_as_its_summary_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sweep = ["algorithm=grpo_none,maxrl_gtpo_sepa", "training.lr=1e-3,1e-4", "training.seed=1,2"]
    start_manifest(tmp_path, expand(sweep), CampaignSettings(), "BasicLauncher", None)
    summarised = [row["condition"] for row in build_summary(collect(tmp_path), plot=None)["conditions"]]
    assert summarised == [
        f"{a} training.lr={lr}" for a in ("grpo_none", "maxrl_gtpo_sepa") for lr in ("0.001", "0.0001")
    ]
    assert explain_main(["--json", "-m", *sweep]) == 0
    conditions = json.loads(capsys.readouterr().out)["conditions"]
    assert [(c["condition"], c["runs"]) for c in conditions] == [(name, 2) for name in summarised]
    assert explain_main(["-m", *sweep]) == 0
    text = capsys.readouterr().out
    assert all(f"Condition {name} [" in text for name in summarised) and f"#0 {summarised[0]} seed=1 " in text


def test_a_pilot_without_steps_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n')
    with pytest.raises(ConfigError, match="--pilot .*: no step with step_time_s"):
        read_pilot(tmp_path)


def test_a_reward_that_does_not_import_is_named_before_any_run(tmp_path: Path, cli_here: CliHere) -> None:
    result = cli_here(
        ["explain", "experiment=quickstart", "reward._target_=no_such_module.reward"], tmp_path, check=False
    )
    assert result.returncode == 1 and "Error getting object" not in result.stderr  # one line, not Hydra's as well
    assert "reward._target_='no_such_module.reward' cannot be imported: ModuleNotFoundError" in result.stderr


def test_a_sweep_of_more_than_algorithm_and_seed_is_explained_as_it_launches(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert explain_main(["--json", "-m", "training.lr=1e-3,1e-4", "training.seed=1,2"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [(Path(run["run_dir"]).name, run["condition"]) for run in report["runs"]] == [
        ("maxrl_gtpo_sepa_s1_lr0.001", "maxrl_gtpo_sepa training.lr=0.001"),
        ("maxrl_gtpo_sepa_s2_lr0.001", "maxrl_gtpo_sepa training.lr=0.001"),
        ("maxrl_gtpo_sepa_s1_lr0.0001", "maxrl_gtpo_sepa training.lr=0.0001"),
        ("maxrl_gtpo_sepa_s2_lr0.0001", "maxrl_gtpo_sepa training.lr=0.0001"),
    ]
    # two rates are two conditions of two seeds each, as the summary counts them
    assert [(c["condition"], c["name"], c["runs"]) for c in report["conditions"]] == [
        ("maxrl_gtpo_sepa training.lr=0.001", "maxrl_gtpo_sepa", 2),
        ("maxrl_gtpo_sepa training.lr=0.0001", "maxrl_gtpo_sepa", 2),
    ]
    # a subdir of one's own that leaves the rate out: refused, as the launch refuses it
    assert explain_main(["-m", "training.lr=1e-3,1e-4", "hydra.sweep.subdir=run_s${training.seed}"]) == 1
    assert capsys.readouterr().err.startswith(
        "retrain explain: jobs #0, #1 would share the run dir run_s-1 (hydra.sweep.subdir=run_s${training.seed}), "
        "which holds one run; they differ in training.lr: name it in the subdir, "
        "e.g. hydra.sweep.subdir='run_s${training.seed}_lr${training.lr}'"
    )
