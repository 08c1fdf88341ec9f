"""Campaigns through the real CLI and Hydra's basic launcher (no cluster needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from retrain.campaign.plan import expand
from tests.conftest import read_metrics, run_cli

QUICK = [
    "experiment=quickstart",
    "training.max_steps=2",
    "training.save_every=0",
    "eval.num_examples=0",
    "logging.progress_bar=false",
]


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


@pytest.mark.slow
def test_basic_multirun_campaign_writes_manifest_and_summary(tmp_path: Path) -> None:
    sweep_dir = tmp_path / "sweep"
    run_cli(
        [
            "--multirun",
            "+campaign=ablation",
            *QUICK,
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
            *QUICK,
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
    manifest = json.loads((sweep_dir / "manifest.json").read_text())
    states = {r["name"]: r for r in manifest["runs"]}
    assert manifest["state"] == "partial"
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
            *QUICK,
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
