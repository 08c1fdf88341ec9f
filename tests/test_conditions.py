"""The five campaign conditions each train on the quickstart experiment, in one real --multirun; a condition
composed from swapped parts runs under the name derived from them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import read_metrics, run_cli

CONDITIONS = ["grpo_none", "maxrl_none", "maxrl_gtpo", "maxrl_gtpo_hicra", "maxrl_gtpo_sepa"]


@pytest.mark.slow
def test_each_condition_runs_three_quickstart_steps(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    run_cli(
        [
            "--multirun",
            "experiment=quickstart",
            f"algorithm={','.join(CONDITIONS)}",
            "training.seed=3",
            "training.max_steps=3",
            "eval.num_examples=0",
            "logging.progress_bar=false",
            # SEPA on from the first step, so that its pooling really runs in these 3 steps
            "algorithm.sepa.delay_steps=0",
            "algorithm.sepa.steps=2",
            "algorithm.sepa.correct_rate_gate=0",
            f"hydra.sweep.dir={sweep}",
        ],
        cwd=tmp_path,
    )
    for condition in CONDITIONS:
        run_dir = sweep / f"{condition}_s3"
        records = read_metrics(run_dir)
        assert [r["step"] for r in records] == [0, 1, 2], condition
        assert all(r["condition"] == condition for r in records)
        assert (run_dir / "final" / "adapter_model.safetensors").is_file()
        assert all("exec_entropy_var" in r and "surprisal/exec_var_after" in r for r in records)
    sepa = read_metrics(sweep / "maxrl_gtpo_sepa_s3")
    assert [r["sepa_lambda"] for r in sepa] == [0.0, 0.5, 1.0]
    assert all(r["sepa_lambda"] == 0.0 for r in read_metrics(sweep / "maxrl_gtpo_hicra_s3"))


@pytest.mark.slow
def test_a_condition_with_a_part_swapped_runs_under_its_derived_name(tmp_path: Path) -> None:
    result = run_cli(
        [
            "experiment=quickstart",
            "algorithm=maxrl_gtpo_sepa",
            "algorithm/advantage=rloo",
            "training.max_steps=1",
            "eval.num_examples=0",
            "logging.progress_bar=false",
        ],
        cwd=tmp_path,
    )
    [run_dir] = (tmp_path / "outputs" / "runs").glob("*/*")  # the default run dir: <date>/<time>_<algorithm.name>
    assert run_dir.name.endswith("_rloo_gtpo_sepa")
    assert [r["condition"] for r in read_metrics(run_dir)] == ["rloo_gtpo_sepa"]
    assert "rloo+gtpo_sepa" in result.stdout  # the console label


@pytest.mark.slow
def test_a_sweep_over_a_part_plans_and_runs_each_derived_condition(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    run_cli(
        [
            "--multirun",
            "experiment=quickstart",
            "algorithm=maxrl_gtpo",
            "algorithm/advantage=rloo,grpo",
            "training.seed=5",
            "training.max_steps=1",
            "training.save_every=0",
            "eval.num_examples=0",
            "logging.progress_bar=false",
            f"hydra.sweep.dir={sweep}",
        ],
        cwd=tmp_path,
    )
    manifest = json.loads((sweep / "manifest.json").read_text())
    assert [job["condition"] for job in manifest["plan"]] == ["rloo_gtpo", "grpo_gtpo"]  # named before they ran
    assert [(run["name"], run["state"]) for run in manifest["runs"]] == [
        ("rloo_gtpo_s5", "done"),
        ("grpo_gtpo_s5", "done"),
    ]
    assert manifest["conditions"] == ["rloo_gtpo", "grpo_gtpo"]
