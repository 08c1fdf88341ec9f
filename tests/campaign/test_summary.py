"""Manifest, summary and plot of a sweep of simulated runs; every number recomputed from raw draws."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest
from scipy import stats as scipy_stats

from retrain.campaign.manifest import MANIFEST, CampaignSettings, collect, start_manifest
from retrain.campaign.plan import expand, overrides_by_key
from retrain.campaign.report import refresh
from retrain.campaign.stats import Estimate
from retrain.campaign.summary import SUMMARY_JSON, SUMMARY_MD, build_summary, render_markdown
from retrain.errors import ConfigError
from tests.campaign.rundirs import SimulatedRun, dead_pid, simulate_run

CONDITIONS = {"grpo_none": (0.3, 1.0), "maxrl_gtpo_hicra": (0.45, 2.0), "maxrl_gtpo_sepa": (0.55, 0.5)}
DONE_SEEDS = [1, 2, 3]
LAST_K = 4


@pytest.fixture
def sweep(tmp_path: Path) -> tuple[Path, dict[str, list[SimulatedRun]]]:
    """3 conditions × 4 seeds planned: seeds 1-3 done; seed 4 failed / dead / never started."""
    sweep_dir = tmp_path / "sweep"
    plan = expand([f"algorithm={','.join(CONDITIONS)}", "training.seed=1,2,3,4", "training.max_steps=12"])
    start_manifest(sweep_dir, plan, CampaignSettings(last_k=LAST_K), "BasicLauncher", None)
    num = {(job.condition, job.seed): job.num for job in plan}
    runs: dict[str, list[SimulatedRun]] = {c: [] for c in CONDITIONS}
    for condition, (p, scale) in CONDITIONS.items():
        for seed in DONE_SEEDS:
            runs[condition].append(
                simulate_run(sweep_dir, condition, seed, p, entropy_scale=scale, num=num[(condition, seed)])
            )
    simulate_run(
        sweep_dir,
        "grpo_none",
        4,
        0.3,
        state="failed",
        error="RuntimeError: CUDA out of memory",
        num=num[("grpo_none", 4)],
    )
    simulate_run(
        sweep_dir, "maxrl_gtpo_hicra", 4, 0.3, state="running", pid=dead_pid(), num=num[("maxrl_gtpo_hicra", 4)]
    )
    manifest = json.loads((sweep_dir / MANIFEST).read_text())
    manifest["driver"] = {"pid": dead_pid(), "hostname": socket.gethostname()}  # the driver is gone
    (sweep_dir / MANIFEST).write_text(json.dumps(manifest))
    return sweep_dir, runs


def test_states_of_runs_and_sweep(sweep: tuple[Path, dict[str, list[SimulatedRun]]]) -> None:
    sweep_dir, _ = sweep
    campaign = collect(sweep_dir)
    states = {run.name: run.state for run in campaign.runs}
    assert len(states) == 12
    assert states["grpo_none_s4"] == "failed"
    assert states["maxrl_gtpo_hicra_s4"] == "dead"  # said running, but its process is gone
    assert states["maxrl_gtpo_sepa_s4"] == "missing"  # planned, never started, launcher gone
    assert sum(s == "done" for s in states.values()) == 9
    assert campaign.state == "partial"
    assert campaign.conditions == list(CONDITIONS) and campaign.seeds == [1, 2, 3, 4]


def test_a_live_driver_keeps_unstarted_runs_pending(sweep: tuple[Path, dict[str, list[SimulatedRun]]]) -> None:
    sweep_dir, _ = sweep
    manifest = json.loads((sweep_dir / MANIFEST).read_text())
    manifest["driver"] = {"pid": os.getpid(), "hostname": socket.gethostname()}
    (sweep_dir / MANIFEST).write_text(json.dumps(manifest))
    campaign = collect(sweep_dir)
    assert {r.name: r.state for r in campaign.runs}["maxrl_gtpo_sepa_s4"] == "pending"
    assert campaign.state == "running"


def test_summary_statistics_match_scipy_on_the_raw_draws(sweep: tuple[Path, dict[str, list[SimulatedRun]]]) -> None:
    sweep_dir, runs = sweep
    refresh(sweep_dir)
    summary = json.loads((sweep_dir / SUMMARY_JSON).read_text())
    assert summary["baseline"] == "grpo_none" and summary["state"] == "partial"
    rows = {row["condition"]: row for row in summary["conditions"]}
    last_k = {c: [float(r.draws[-LAST_K:].mean()) for r in rs] for c, rs in runs.items()}
    pooled = {
        c: (sum(int(r.draws[-LAST_K:].sum()) for r in rs), sum(r.draws[-LAST_K:].size for r in rs))
        for c, rs in runs.items()
    }
    for condition, row in rows.items():
        assert (row["done"], row["runs"]) == (3, 4)
        finals = [float(r.draws[-1].mean()) for r in runs[condition]]
        assert row["final"]["mean"] == pytest.approx(np.mean(finals))
        assert row["last_k"]["mean"] == pytest.approx(np.mean(last_k[condition]))
        assert row["last_k"]["std"] == pytest.approx(np.std(last_k[condition], ddof=1))
        low, high = scipy_stats.t.interval(
            0.95, 2, loc=np.mean(last_k[condition]), scale=scipy_stats.sem(last_k[condition])
        )
        assert (row["last_k"]["ci_low"], row["last_k"]["ci_high"]) == (pytest.approx(low), pytest.approx(high))
        assert (row["pooled"]["correct"], row["pooled"]["total"]) == pooled[condition]
    for condition in ("maxrl_gtpo_hicra", "maxrl_gtpo_sepa"):
        (c1, t1), (c0, t0) = pooled[condition], pooled["grpo_none"]
        fisher = scipy_stats.fisher_exact([[c1, t1 - c1], [c0, t0 - c0]])
        assert rows[condition]["fisher_vs_baseline"]["p_value"] == pytest.approx(fisher.pvalue)
        welch = scipy_stats.ttest_ind(last_k[condition], last_k["grpo_none"], equal_var=False)
        assert rows[condition]["welch_vs_baseline"]["p_value"] == pytest.approx(welch.pvalue)
    assert rows["grpo_none"]["fisher_vs_baseline"] is None  # the baseline is not tested against itself

    comparison = summary["entropy_comparison"]
    entropy = {c: [float(r.entropy_var[-LAST_K:].mean()) for r in runs[c]] for c in comparison["conditions"]}
    assert comparison["conditions"] == ["maxrl_gtpo_sepa", "maxrl_gtpo_hicra"]
    for condition, values in entropy.items():
        assert comparison[condition]["mean"] == pytest.approx(np.mean(values))
    welch = scipy_stats.ttest_ind(*entropy.values(), equal_var=False)
    assert comparison["welch"]["p_value"] == pytest.approx(welch.pvalue)


def test_markdown_names_every_run_and_reports_failures(sweep: tuple[Path, dict[str, list[SimulatedRun]]]) -> None:
    sweep_dir, _ = sweep
    refresh(sweep_dir)
    text = (sweep_dir / SUMMARY_MD).read_text()
    for condition in CONDITIONS:
        for seed in [*DONE_SEEDS, 4]:
            assert f"`{condition}_s{seed}`" in text
    assert "## Failed or lost runs" in text
    assert "`grpo_none_s4` (failed): RuntimeError: CUDA out of memory" in text
    assert "`maxrl_gtpo_hicra_s4` (dead)" in text and "`maxrl_gtpo_sepa_s4` (missing)" in text
    assert "state: **partial**" in text
    manifest = json.loads((sweep_dir / MANIFEST).read_text())
    assert manifest["conditions"] == list(CONDITIONS) and manifest["seeds"] == [1, 2, 3, 4]
    assert {r["name"]: r["state"] for r in manifest["runs"]}["grpo_none_s4"] == "failed"
    assert len(manifest["plan"]) == 12


def test_learning_curves_png_has_a_band_per_condition(sweep: tuple[Path, dict[str, list[SimulatedRun]]]) -> None:
    sweep_dir, _ = sweep
    refresh(sweep_dir)
    image = matplotlib.image.imread(sweep_dir / "learning_curves.png")
    assert image.shape[0] > 300 and image.shape[1] > 1000  # three panels side by side
    assert "![learning curves](learning_curves.png)" in (sweep_dir / SUMMARY_MD).read_text()


def simulated_sweep(sweep_dir: Path, arguments: list[str], p_correct: dict[tuple[str, str], float]) -> dict:
    """Every planned job of `arguments` done, at `p_correct[(algorithm, lr)]`; the summary it gets."""
    plan = expand([*arguments, "training.seed=1,2,3"])
    start_manifest(sweep_dir, plan, CampaignSettings(last_k=LAST_K), "BasicLauncher", None)
    last_k: dict[tuple[str, str], list[float]] = {}
    for job in plan:
        condition = job.condition or "maxrl_gtpo_sepa"
        lr = overrides_by_key(job.overrides)["training.lr"]
        name = f"{condition}_s{job.seed}_lr{lr}"
        run = simulate_run(sweep_dir, condition, job.seed, p_correct[(condition, lr)], num=job.num, name=name)
        last_k.setdefault((condition, lr), []).append(float(run.draws[-LAST_K:].mean()))
    return {"summary": build_summary(collect(sweep_dir), plot=None), "last_k": last_k}


def test_a_condition_is_every_swept_setting_but_the_seed(tmp_path: Path) -> None:
    p_correct = {("grpo_none", "0.001"): 0.3, ("grpo_none", "0.0001"): 0.2}
    p_correct |= {("maxrl_gtpo_sepa", "0.001"): 0.6, ("maxrl_gtpo_sepa", "0.0001"): 0.25}
    swept = simulated_sweep(tmp_path, ["algorithm=grpo_none,maxrl_gtpo_sepa", "training.lr=1e-3,1e-4"], p_correct)
    summary, last_k = swept["summary"], swept["last_k"]
    rows = {row["condition"]: row for row in summary["conditions"]}
    labels = [f"{algorithm} training.lr={lr}" for algorithm, lr in p_correct]
    assert sorted(rows) == sorted(labels) and summary["baseline"] == "grpo_none"
    for (algorithm, lr), values in last_k.items():
        row = rows[f"{algorithm} training.lr={lr}"]
        assert (row["done"], row["seeds_done"]) == (3, [1, 2, 3])  # three seeds, never the other rate's runs
        assert row["last_k"]["mean"] == pytest.approx(np.mean(values))
    for lr in ("0.001", "0.0001"):  # tested against the baseline at the same rate: they differ in the algorithm only
        sepa, grpo = rows[f"maxrl_gtpo_sepa training.lr={lr}"], f"grpo_none training.lr={lr}"
        assert sepa["baseline"] == grpo and rows[grpo]["is_baseline"] and rows[grpo]["welch_vs_baseline"] is None
        welch = scipy_stats.ttest_ind(last_k[("maxrl_gtpo_sepa", lr)], last_k[("grpo_none", lr)], equal_var=False)
        assert sepa["welch_vs_baseline"]["p_value"] == pytest.approx(welch.pvalue)
    assert "| `maxrl_gtpo_sepa training.lr=0.0001` | 3/3 |" in render_markdown(summary)


def test_jobs_not_started_yet_are_named_apart_by_their_settings(tmp_path: Path) -> None:
    plan = expand(["training.lr=1e-3,1e-4", "training.seed=1"])
    start_manifest(tmp_path, plan, CampaignSettings(), "BasicLauncher", None)
    runs = collect(tmp_path).runs  # the driver (this process) is alive: both pending
    assert [(run.name, run.state) for run in runs] == [("job0_lr0.001", "pending"), ("job1_lr0.0001", "pending")]


def test_a_sweep_without_the_baseline_tests_against_its_first_condition(tmp_path: Path) -> None:
    p_correct = {("maxrl_gtpo_sepa", "0.001"): 0.6, ("maxrl_gtpo_sepa", "0.0001"): 0.25}
    swept = simulated_sweep(tmp_path, ["training.lr=1e-3,1e-4"], p_correct)
    summary, last_k = swept["summary"], swept["last_k"]
    first, second = summary["conditions"]
    assert (first["condition"], second["condition"]) == (
        "maxrl_gtpo_sepa training.lr=0.001",
        "maxrl_gtpo_sepa training.lr=0.0001",
    )
    assert (
        first["is_baseline"] and second["baseline"] == first["condition"] and summary["baseline"] == first["condition"]
    )
    assert (first["done"], second["done"]) == (3, 3)  # not one condition of 6 "seeds"
    welch = scipy_stats.ttest_ind(
        last_k[("maxrl_gtpo_sepa", "0.0001")], last_k[("maxrl_gtpo_sepa", "0.001")], equal_var=False
    )
    assert second["welch_vs_baseline"]["p_value"] == pytest.approx(welch.pvalue)


def test_a_baseline_naming_a_whole_condition_is_every_conditions(tmp_path: Path) -> None:
    """`+campaign=recipes` sweeps a setting, not the algorithm: its baseline is the condition `grpo_std_none
    recipe=grpo`, which each recipe is tested against, though it is not the sweep's first."""
    advantage = {"gspo": "grpo_std_none", "dr_grpo": "grpo_none", "grpo": "grpo_std_none"}
    p_correct = {"gspo": 0.5, "dr_grpo": 0.4, "grpo": 0.3}
    plan = expand(["recipe=gspo,dr_grpo,grpo", "training.seed=1,2,3"])
    baseline = "grpo_std_none recipe=grpo"
    start_manifest(tmp_path, plan, CampaignSettings(baseline=baseline, last_k=LAST_K), "BasicLauncher", None)
    last_k: dict[str, list[float]] = {}
    for job in plan:
        recipe = overrides_by_key(job.overrides)["recipe"]
        name = f"{recipe}_s{job.seed}"
        run = simulate_run(tmp_path, advantage[recipe], job.seed, p_correct[recipe], num=job.num, name=name)
        last_k.setdefault(recipe, []).append(float(run.draws[-LAST_K:].mean()))
    summary = build_summary(collect(tmp_path), plot=None)
    rows = {row["condition"]: row for row in summary["conditions"]}
    assert sorted(rows) == sorted(f"{advantage[r]} recipe={r}" for r in advantage)
    assert summary["baseline"] == baseline and summary["baseline_note"] is None
    assert all(row["baseline"] == baseline for row in rows.values()) and rows[baseline]["is_baseline"]
    for recipe in ("gspo", "dr_grpo"):
        welch = scipy_stats.ttest_ind(last_k[recipe], last_k["grpo"], equal_var=False)
        assert rows[f"{advantage[recipe]} recipe={recipe}"]["welch_vs_baseline"]["p_value"] == pytest.approx(
            welch.pvalue
        )


@pytest.mark.parametrize(
    ("setting", "named"),
    [
        ({"last_k": "abc"}, "hydra.callbacks.campaign.last_k='abc': must be an integer >= 1"),
        ({"last_k": 0}, "hydra.callbacks.campaign.last_k=0"),
        ({"confidence": 1.0}, "hydra.callbacks.campaign.confidence=1.0: must be in (0, 1)"),
        ({"confidence": "high"}, "hydra.callbacks.campaign.confidence='high'"),
        ({"entropy_pair": ["a"]}, "hydra.callbacks.campaign.entropy_pair=['a']"),
        ({"baseline": 3}, "hydra.callbacks.campaign.baseline=3"),
    ],
)
def test_a_comparison_setting_that_cannot_work_is_named(setting: dict[str, object], named: str) -> None:
    with pytest.raises(ConfigError) as raised:
        CampaignSettings(**setting)  # type: ignore[arg-type]
    assert named in str(raised.value)


def test_a_baseline_without_a_readable_run_is_named_not_replaced(
    sweep: tuple[Path, dict[str, list[SimulatedRun]]],
) -> None:
    sweep_dir, _ = sweep
    for run_dir in sweep_dir.iterdir():
        if run_dir.name.startswith("grpo_none_s"):
            (run_dir / "status.json").write_bytes(b"\xff{")  # every baseline run unreadable
    refresh(sweep_dir)
    summary = json.loads((sweep_dir / SUMMARY_JSON).read_text())
    assert summary["baseline"] == "grpo_none"
    assert summary["baseline_note"] == "the baseline `grpo_none` has no readable run: no condition is tested against it"
    rows = {row["condition"]: row for row in summary["conditions"]}
    assert "grpo_none" not in rows and not any(row["is_baseline"] for row in rows.values())
    assert all(row["fisher_vs_baseline"] is None and row["welch_vs_baseline"] is None for row in rows.values())
    text = (sweep_dir / SUMMARY_MD).read_text()
    assert "**the baseline `grpo_none` has no readable run" in text and "(baseline)" not in text


HELD_OUT = {"grpo_none": (0.2, 0.3), "maxrl_gtpo_sepa": (0.2, 0.65)}  # held-out p(correct) before, after


def held_out_sweep(sweep_dir: Path) -> dict[str, list[SimulatedRun]]:
    """2 conditions × 3 seeds, all done, each measuring held-out accuracy before, every 4 steps, and after."""
    plan = expand([f"algorithm={','.join(HELD_OUT)}", "training.seed=1,2,3", "training.max_steps=12"])
    start_manifest(sweep_dir, plan, CampaignSettings(last_k=LAST_K), "BasicLauncher", None)
    runs: dict[str, list[SimulatedRun]] = {c: [] for c in HELD_OUT}
    for job in plan:
        assert job.condition is not None and job.seed is not None
        run = simulate_run(sweep_dir, job.condition, job.seed, 0.4, num=job.num, held_out=HELD_OUT[job.condition])
        runs[job.condition].append(run)
    return runs


def test_held_out_accuracy_gets_the_statistics_of_the_correct_rate(tmp_path: Path) -> None:
    runs = held_out_sweep(tmp_path)
    refresh(tmp_path)
    summary = json.loads((tmp_path / SUMMARY_JSON).read_text())
    rows = {row["condition"]: row for row in summary["conditions"]}
    after: dict[tuple[str, str], list[float]] = {}
    for condition, simulated in runs.items():
        for kind in ("greedy", "sampled"):
            figures = rows[condition]["held_out"][kind]
            before = [r.eval[f"eval/before_{kind}_accuracy"] for r in simulated]
            after[(condition, kind)] = [r.eval[f"eval/after_{kind}_accuracy"] for r in simulated]
            values = after[(condition, kind)]
            assert figures["before"]["mean"] == pytest.approx(np.mean(before))
            assert figures["after"]["mean"] == pytest.approx(np.mean(values))
            assert figures["after"]["std"] == pytest.approx(np.std(values, ddof=1))
            low, high = scipy_stats.t.interval(0.95, 2, loc=np.mean(values), scale=scipy_stats.sem(values))
            assert (figures["after"]["ci_low"], figures["after"]["ci_high"]) == (
                pytest.approx(low),
                pytest.approx(high),
            )
            assert figures["gain"]["mean"] == pytest.approx(np.mean(np.subtract(values, before)))
            assert figures["points"] == []  # no eval.every
    for kind in ("greedy", "sampled"):
        welch = scipy_stats.ttest_ind(after[("maxrl_gtpo_sepa", kind)], after[("grpo_none", kind)], equal_var=False)
        assert rows["maxrl_gtpo_sepa"]["held_out"][kind]["welch_vs_baseline"]["p_value"] == pytest.approx(welch.pvalue)
        assert rows["grpo_none"]["held_out"][kind]["welch_vs_baseline"] is None  # the baseline itself
    assert summary["runs"][0]["held_out_after"] == {
        "greedy": runs["grpo_none"][0].eval["eval/after_greedy_accuracy"],
        "sampled": runs["grpo_none"][0].eval["eval/after_sampled_accuracy"],
    }
    text = (tmp_path / SUMMARY_MD).read_text()
    sepa = rows["maxrl_gtpo_sepa"]["held_out"]["greedy"]
    assert "## Held-out accuracy" in text and "During training" not in text
    assert (
        f"| `maxrl_gtpo_sepa` | greedy | {Estimate(**sepa['before']).text()} | {Estimate(**sepa['after']).text()} |"
        in text
    )
    # before and after are two points of a curve: the plot is drawn, a panel per kind
    assert "![held-out accuracy](held_out_accuracy.png)" in text
    height, width, _ = matplotlib.image.imread(tmp_path / "held_out_accuracy.png").shape
    assert width > 1.5 * height


def test_held_out_accuracy_during_training_is_estimated_at_each_recorded_step(tmp_path: Path) -> None:
    plan = expand(["algorithm=grpo_none", "training.seed=1,2,3", "training.max_steps=12"])
    start_manifest(tmp_path, plan, CampaignSettings(last_k=LAST_K), "BasicLauncher", None)
    runs = [
        simulate_run(tmp_path, "grpo_none", job.seed or 0, 0.4, num=job.num, held_out=(0.1, 0.9), eval_every=4)
        for job in plan
    ]
    summary = build_summary(collect(tmp_path), plot=None)
    steps = sorted(runs[0].eval_points)  # the steps of the metrics records that hold them, whatever the convention
    assert len(steps) == 2
    for kind in ("greedy", "sampled"):
        points = summary["conditions"][0]["held_out"][kind]["points"]
        assert [point["step"] for point in points] == steps
        for point in points:
            values = [run.eval_points[point["step"]][kind] for run in runs]
            assert point["mean"] == pytest.approx(np.mean(values))
            assert point["std"] == pytest.approx(np.std(values, ddof=1))
    text = render_markdown(summary)
    assert "During training (`eval.every`)" in text
    assert f"| condition | kind | step {steps[0]} | step {steps[1]} |" in text


def test_a_sweep_that_measured_nothing_held_out_has_no_held_out_section(
    sweep: tuple[Path, dict[str, list[SimulatedRun]]],
) -> None:
    sweep_dir, _ = sweep
    refresh(sweep_dir)
    summary = json.loads((sweep_dir / SUMMARY_JSON).read_text())
    assert all(row["held_out"] == {} for row in summary["conditions"]) and summary["held_out_plot"] is None
    assert "Held-out accuracy" not in (sweep_dir / SUMMARY_MD).read_text()
    assert not (sweep_dir / "held_out_accuracy.png").exists()
