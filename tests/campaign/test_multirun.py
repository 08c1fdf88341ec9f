"""Campaigns through the real CLI and Hydra's basic launcher (no cluster needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from retrain.campaign.plan import expand
from tests.conftest import QUICK, CliHere, read_metrics, run_cli

QUICK_SWEEP = [*QUICK, "training.max_steps=2", "training.save_every=0"]


def test_ablation_preset_plans_five_conditions_by_eight_seeds(tmp_path: Path) -> None:
    """The preset's sweep, expanded exactly as Hydra will launch it (and overridable from the CLI)."""
    result = run_cli(["+campaign=ablation", "--cfg", "hydra", "--package", "hydra.sweeper"], cwd=tmp_path)
    params = yaml.safe_load(result.stdout)["params"]
    plan = expand([f"{k}={v}" for k, v in params.items()])
    conditions = ["grpo_none", "maxrl_none", "maxrl_gtpo", "maxrl_gtpo_hicra", "maxrl_gtpo_sepa"]
    seeds = [42, 101, 202, 303, 404, 505, 606, 707]
    assert [(j.condition, j.seed) for j in plan] == [(c, s) for c in conditions for s in seeds]
    narrowed = expand([f"{k}={v}" for k, v in params.items()] + ["training.seed=1,2", "algorithm=grpo_none"])
    assert [(j.condition, j.seed) for j in narrowed] == [("grpo_none", 1), ("grpo_none", 2)]


def test_campaign_wandb_names_follow_condition_and_seed(tmp_path: Path) -> None:
    result = run_cli(
        [
            "+campaign=ablation",
            "algorithm=maxrl_gtpo_hicra",
            "training.seed=303",
            "--cfg",
            "job",
            "--resolve",
            "--package",
            "logging",
        ],
        cwd=tmp_path,
    )
    logging_cfg = yaml.safe_load(result.stdout)
    assert logging_cfg["wandb_group"] == "maxrl_gtpo_hicra"
    assert logging_cfg["wandb_run_name"] == "maxrl_gtpo_hicra_s303"
    assert logging_cfg["wandb_tags"] == ["maxrl_gtpo_hicra", "seed303"]


def test_the_default_run_dirs_name_every_swept_key(tmp_path: Path, cli_here: CliHere) -> None:
    sweep_dir = tmp_path / "sweep"
    arguments = ["--multirun", *QUICK, "training.lr=-1,-2", f"hydra.sweep.dir={sweep_dir}"]
    result = cli_here(arguments, tmp_path, check=False)  # a negative rate: each job fails as it starts
    assert result.returncode == 1 and "retrain: job #0 (" in result.stderr and "must be > 0" in result.stderr
    assert sorted(p.name for p in sweep_dir.iterdir() if p.is_dir()) == [
        "maxrl_gtpo_sepa_s0_lr-1.0",
        "maxrl_gtpo_sepa_s0_lr-2.0",
    ]
    assert "Run dirs name every swept key: hydra.sweep.subdir=${algorithm.name}_s${training.seed}_lr${training.lr}" in (
        result.stdout
    )


def test_jobs_that_would_share_a_run_dir_stop_the_sweep_before_it_starts(tmp_path: Path, cli_here: CliHere) -> None:
    sweep_dir = tmp_path / "sweep"
    unnamed = "hydra.sweep.subdir=run_s${training.seed}"  # a subdir of one's own that leaves the rate out
    result = cli_here(
        ["--multirun", *QUICK_SWEEP, "training.lr=1e-3,1e-4", f"hydra.sweep.dir={sweep_dir}", unnamed],
        tmp_path,
        check=False,
    )
    assert result.returncode == 1 and not sweep_dir.exists()
    assert "retrain: jobs #0, #1 would share the run dir run_s0" in result.stderr, result.stderr
    assert "they differ in training.lr" in result.stderr and "Traceback" not in result.stderr
    # the subdir the message suggests tells them apart
    key, _, value = result.stderr.split("e.g. ", 1)[1].strip().partition("=")
    suggested = f"{key}={value.strip(chr(39))}"  # as a shell passes it, without the quotes
    arguments = ["--multirun", *QUICK_SWEEP, "training.lr=-1,-2", f"hydra.sweep.dir={sweep_dir}", suggested]
    plan = cli_here(arguments, tmp_path, check=False)
    assert sorted(p.name for p in sweep_dir.iterdir() if p.is_dir()) == ["run_s0_lr-1.0", "run_s0_lr-2.0"]
    assert plan.returncode == 1 and "retrain: job #0 (" in plan.stderr and "must be > 0" in plan.stderr
    assert "Traceback" not in plan.stderr, plan.stderr  # each job's user error is one line, the sweep's too
    assert "UserWarning" not in plan.stderr and (sweep_dir / "manifest.json").is_file()
    # a name only the launch resolves (the job's number) is the launcher's to keep apart: no check, no warning
    numbered = ["--multirun", *QUICK_SWEEP, "training.lr=-1,-2", f"hydra.sweep.dir={tmp_path / 'numbered'}"]
    result = cli_here([*numbered, "hydra.sweep.subdir=job${hydra.job.num}"], tmp_path, check=False)
    assert "UserWarning" not in result.stderr and "retrain: job #0 (" in result.stderr, result.stderr
    assert json.loads((tmp_path / "numbered" / "manifest.json").read_text())["plan"] is not None


def test_a_campaign_setting_that_cannot_work_stops_the_sweep_before_it_starts(
    tmp_path: Path, cli_here: CliHere
) -> None:
    sweep_dir = tmp_path / "sweep"
    for setting, message in [
        ("squeeze.min_variance_retention=high", "squeeze.min_variance_retention='high': must be a number in (0, 1]"),
        ("+squeeze.retention=0.9", "squeeze: unknown key(s) ['retention']"),
    ]:
        arguments = [
            "--multirun",
            "+campaign=ablation",
            *QUICK_SWEEP,
            "algorithm=grpo_none",
            "training.seed=1",
            setting,
        ]
        result = cli_here([*arguments, f"hydra.sweep.dir={sweep_dir}"], tmp_path, check=False)
        assert result.returncode == 1 and f"retrain: {message}" in result.stderr, result.stderr
        assert not sweep_dir.exists()  # no job ran, nothing was written


def test_campaign_settings_are_overridden_without_a_plus(tmp_path: Path) -> None:
    result = run_cli(
        ["--cfg", "hydra", "--package", "hydra.callbacks", "hydra.callbacks.campaign.confidence=0.9"], tmp_path
    )
    assert yaml.safe_load(result.stdout)["campaign"]["confidence"] == 0.9


def test_a_real_sweep_summarises_the_held_out_accuracy_its_run_measured(tmp_path: Path, cli_here: CliHere) -> None:
    sweep_dir = tmp_path / "sweep"
    held_out = ["eval.num_examples=4", "eval.every=1"]  # before, after step 1 (of 2), after training
    cli_here(["--multirun", *QUICK_SWEEP, *held_out, "training.seed=1", f"hydra.sweep.dir={sweep_dir}"], tmp_path)
    run_dir = sweep_dir / "maxrl_gtpo_sepa_s1"
    measured = json.loads((run_dir / "status.json").read_text())["eval"]
    during = [record for record in read_metrics(run_dir) if "eval/greedy_accuracy" in record]
    summary = json.loads((sweep_dir / "summary.json").read_text())
    [row] = summary["conditions"]
    for kind in ("greedy", "sampled"):
        figures = row["held_out"][kind]
        assert figures["before"]["mean"] == pytest.approx(measured[f"eval/before_{kind}_accuracy"])
        assert figures["after"]["mean"] == pytest.approx(measured[f"eval/after_{kind}_accuracy"])
        assert [(p["step"], p["mean"]) for p in figures["points"]] == [
            (record["step"], pytest.approx(record[f"eval/{kind}_accuracy"])) for record in during
        ]
    assert len(during) == 1 and summary["held_out_plot"] == "held_out_accuracy.png"
    assert (sweep_dir / "held_out_accuracy.png").is_file()
    assert "## Held-out accuracy" in (sweep_dir / "summary.md").read_text()


@pytest.mark.slow
def test_basic_multirun_campaign_writes_manifest_and_summary(tmp_path: Path) -> None:
    sweep_dir = tmp_path / "sweep"
    run_cli(
        [
            "--multirun",
            "+campaign=ablation",
            *QUICK_SWEEP,
            "algorithm=grpo_none,maxrl_gtpo_sepa",
            "training.seed=1,2",
            f"hydra.sweep.dir={sweep_dir}",
            "squeeze.target_ranks=[1,2,4]",
        ],
        cwd=tmp_path,
    )
    names = [f"{c}_s{s}" for c in ("grpo_none", "maxrl_gtpo_sepa") for s in (1, 2)]
    for name in names:
        run_dir = sweep_dir / name
        assert [r["step"] for r in read_metrics(run_dir)] == [0, 1], name
        assert (run_dir / "final" / "adapter_model.safetensors").is_file(), name
        assert json.loads((run_dir / "exit.json").read_text())["status"] == "completed"
    manifest = json.loads((sweep_dir / "manifest.json").read_text())
    assert manifest["state"] == "done" and manifest["conditions"] == ["grpo_none", "maxrl_gtpo_sepa"]
    assert manifest["driver"]["alive"] is False  # written by the driver as it ended
    assert manifest["seeds"] == [1, 2] and manifest["launcher"] == "BasicLauncher"
    assert [(r["name"], r["state"]) for r in manifest["runs"]] == [(n, "done") for n in names]
    summary = (sweep_dir / "summary.md").read_text()
    for name in names:
        assert f"`{name}`" in summary
    assert (sweep_dir / "learning_curves.png").is_file()
    # auto-squeeze analysed the first finished run's adapter
    squeeze = json.loads((sweep_dir / "squeeze.json").read_text())
    assert squeeze["run"] == "grpo_none_s1" and squeeze["report"]["target_ranks"] == [1, 2, 4]
    assert manifest["squeeze"]["report"]["recommended_rank"] == squeeze["report"]["recommended_rank"]
    assert "## LoRA-Squeeze of `grpo_none_s1`" in summary

    status = run_cli(["status", str(sweep_dir)], cwd=tmp_path).stdout
    assert "state: **done** (4 done)" in status


@pytest.mark.slow
def test_a_failing_run_is_reported_not_hidden(tmp_path: Path) -> None:
    sweep_dir = tmp_path / "sweep"
    # the second job names a reward that does not exist: it fails, the first one finishes
    result = run_cli(
        [
            "--multirun",
            "+campaign=ablation",
            *QUICK_SWEEP,
            "algorithm=grpo_none",
            "training.seed=1",
            "reward._target_=retrain.reward.match.match_reward,retrain.reward.no_such_reward",
            f"hydra.sweep.dir={sweep_dir}",
            "hydra.sweep.subdir=job${hydra.job.num}",
            "squeeze=null",
        ],
        cwd=tmp_path,
        check=False,
    )
    assert result.returncode != 0  # Hydra fails the sweep, after running every job
    assert "retrain: job #1 (" in result.stderr and "Traceback" not in result.stderr, result.stderr
    manifest = json.loads((sweep_dir / "manifest.json").read_text())
    states = {r["name"]: r for r in manifest["runs"]}
    assert manifest["state"] == "partial" and manifest["driver"]["alive"] is False
    assert states["job0"]["state"] == "done"
    assert states["job1"]["state"] == "failed" and "no_such_reward" in states["job1"]["error"]
    summary = (sweep_dir / "summary.md").read_text()
    assert "## Failed or lost runs" in summary and "`job1` (failed)" in summary


@pytest.mark.slow
def test_local_submitit_launcher_runs_each_job_in_its_own_process(tmp_path: Path) -> None:
    sweep_dir = tmp_path / "sweep"
    run_cli(
        [
            "--multirun",
            "+campaign=ablation",
            *QUICK_SWEEP,
            "algorithm=grpo_none",
            "training.seed=1,2",
            "hydra/launcher=local",
            f"hydra.sweep.dir={sweep_dir}",
            "squeeze=null",
        ],
        cwd=tmp_path,
    )
    manifest = json.loads((sweep_dir / "manifest.json").read_text())
    assert manifest["launcher"] == "LocalLauncher" and manifest["state"] == "done"
    pids = {json.loads((sweep_dir / f"grpo_none_s{seed}" / "job.json").read_text())["pid"] for seed in (1, 2)}
    assert len(pids) == 2 and manifest["driver"]["pid"] not in pids
