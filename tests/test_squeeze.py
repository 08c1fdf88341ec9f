"""LoRA-Squeeze on real PEFT adapters of a tiny randomly initialised Qwen3 (docs/squeeze.md)."""

from __future__ import annotations

import hashlib
import json
import re
import stat
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config, Qwen3ForCausalLM

from retrain.housekeeping.file_modes import current_umask
from retrain.housekeeping.rundir import RunDir
from retrain.model.peft_files import ADAPTER_WEIGHTS
from retrain.squeeze import (
    SqueezeError,
    SqueezeSettings,
    analyse,
    compress,
    default_target_ranks,
    lora_modules,
    main,
    read_adapter,
)

RANK = 8
ALPHA = 16
TARGETS = ["q_proj", "v_proj", "down_proj"]


def tiny_base(seed: int = 0) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )
    return Qwen3ForCausalLM(config).eval()


def save_adapter(path: Path, use_rslora: bool = False) -> Path:
    """A real PEFT adapter whose B factors are non-zero (init_lora_weights=False draws both at random)."""
    model = get_peft_model(
        tiny_base(),
        LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS, init_lora_weights=False, use_rslora=use_rslora),
    )
    model.save_pretrained(str(path))
    return path


def delta_weights(adapter_dir: Path) -> dict[str, torch.Tensor]:
    """ΔW of every targeted linear layer, as PEFT itself computes it after loading the adapter."""
    model = PeftModel.from_pretrained(tiny_base(), str(adapter_dir))
    deltas = {}
    for name, module in model.named_modules():
        if hasattr(module, "get_delta_weight") and "default" in getattr(module, "lora_A", {}):
            deltas[name] = module.get_delta_weight("default").detach().double()
    assert deltas, "PEFT loaded no LoRA layers"
    return deltas


@pytest.fixture
def adapter(tmp_path: Path) -> Path:
    return save_adapter(tmp_path / "adapter")


def test_singular_values_and_retention_match_a_direct_svd(adapter: Path) -> None:
    report = analyse(adapter, min_variance_retention=0.9)
    _, weights = read_adapter(adapter)
    modules = lora_modules(weights)
    assert report.num_modules == len(modules) == 2 * len(TARGETS)
    assert report.target_ranks == [1, 2, 4, 8] == default_target_ranks(RANK)
    for module in modules:
        s = torch.linalg.svdvals(module.B.double() @ module.A.double())
        energy = s.square() / s.square().sum()
        for k in report.target_ranks:
            assert report.module_retention[module.name][k] == pytest.approx(float(energy[:k].sum()), abs=1e-9)
    means = [report.mean_retention[k] for k in report.target_ranks]
    assert means == sorted(means) and means[-1] == pytest.approx(1.0)
    expected = next(k for k in report.target_ranks if report.mean_retention[k] >= 0.9)
    assert report.recommended_rank == expected


def test_compressing_to_full_rank_reproduces_delta_w(adapter: Path, tmp_path: Path) -> None:
    out = compress(adapter, RANK, tmp_path / "full")
    original, squeezed = delta_weights(adapter), delta_weights(out)
    assert original.keys() == squeezed.keys()
    for name in original:
        torch.testing.assert_close(squeezed[name], original[name], rtol=1e-5, atol=1e-6)
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == RANK and config["lora_alpha"] == pytest.approx(ALPHA)


@pytest.mark.parametrize("use_rslora", [False, True])
def test_compression_keeps_the_best_rank_k_approximation(tmp_path: Path, use_rslora: bool) -> None:
    adapter = save_adapter(tmp_path / "adapter", use_rslora=use_rslora)
    k = 2
    out = compress(adapter, k, tmp_path / "r2")
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == k
    expected_alpha = ALPHA * ((k / RANK) ** 0.5 if use_rslora else k / RANK)
    assert config["lora_alpha"] == pytest.approx(expected_alpha)
    for factor in load_file(str(out / ADAPTER_WEIGHTS)).values():
        assert k in factor.shape
    original, squeezed = delta_weights(adapter), delta_weights(out)
    for name, delta in original.items():
        # Eckart–Young: the best rank-k approximation leaves exactly the tail singular values
        s = torch.linalg.svdvals(delta)
        error = torch.linalg.matrix_norm(delta - squeezed[name]).square()
        assert float(error) == pytest.approx(float(s[k:].square().sum()), rel=1e-4, abs=1e-10)
        assert torch.linalg.matrix_rank(squeezed[name], rtol=1e-6) <= k


def test_recommends_the_rank_the_update_really_has(tmp_path: Path) -> None:
    adapter = save_adapter(tmp_path / "adapter")
    weights = load_file(str(adapter / ADAPTER_WEIGHTS))
    for key in [k for k in weights if k.endswith("lora_B.weight")]:
        weights[key] = weights[key].clone()
        weights[key][:, 2:] = 0.0  # B·A now has rank 2 in every module
    save_file(weights, str(adapter / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    report = analyse(adapter, min_variance_retention=0.999)
    assert report.mean_retention[2] == pytest.approx(1.0)
    assert report.mean_retention[1] < 0.999
    assert report.recommended_rank == 2


def test_a_zero_update_retains_everything_at_rank_one(tmp_path: Path) -> None:
    adapter = tmp_path / "zero"
    get_peft_model(tiny_base(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"])).save_pretrained(str(adapter))
    report = analyse(adapter)  # PEFT's default init: B = 0, so ΔW = 0
    assert all(v == 1.0 for v in report.mean_retention.values())
    assert report.recommended_rank == 1


def test_cli_prints_table_and_writes_a_loadable_adapter(
    adapter: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    final_dir = RunDir(run_dir).final_dir
    final_dir.mkdir(parents=True)
    for file in adapter.iterdir():
        (final_dir / file.name).write_bytes(file.read_bytes())
    out = tmp_path / "squeezed"
    assert main([str(run_dir), "--compress-to", "4", "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| rank | mean variance retained |" in printed and "Recommended rank" in printed
    assert f"Wrote the rank-4 adapter to {out}" in printed
    model = PeftModel.from_pretrained(tiny_base(), str(out))
    assert model.peft_config["default"].r == 4
    report = json.loads((out / "squeeze.json").read_text())
    assert report["compressed_rank"] == 4 and report["source_rank"] == RANK
    # as readable as the report beside it (safetensors alone writes its file 0600)
    assert stat.S_IMODE((out / ADAPTER_WEIGHTS).stat().st_mode) == 0o666 & ~current_umask()

    assert main([str(adapter), "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["recommended_rank"] in payload["target_ranks"] and payload["output"] is None

    # an adapter already there is replaced only when asked to
    before = (out / ADAPTER_WEIGHTS).read_bytes()
    assert main([str(run_dir), "--compress-to", "2", "--output", str(out)]) == 2
    assert "holds an adapter already (--force replaces it)" in capsys.readouterr().err
    assert (out / ADAPTER_WEIGHTS).read_bytes() == before
    assert main([str(run_dir), "--compress-to", "2", "--output", str(out), "--force"]) == 0
    assert PeftModel.from_pretrained(tiny_base(), str(out)).peft_config["default"].r == 2


def test_bad_input_gets_a_clear_error(adapter: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path / "nowhere")]) == 2
    assert "no PEFT adapter here" in capsys.readouterr().err
    assert main([str(adapter), "--compress-to", "16", "--output", str(tmp_path / "x")]) == 2
    assert "between 1 and the adapter's rank 8" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([str(adapter), "--compress-to", "2"])
    assert "--compress-to needs --output" in capsys.readouterr().err
    with pytest.raises(SqueezeError, match="unknown key.*'retention'"):
        SqueezeSettings.from_mapping({"retention": 0.9})
    with pytest.raises(SystemExit):
        main([str(adapter), "--min-variance-retention", "1.5"])
    assert "argument --min-variance-retention: '1.5' is not a number in (0, 1]" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"min_variance_retention": 1.5}, "squeeze.min_variance_retention=1.5: must be a number in (0, 1]"),
        ({"min_variance_retention": "high"}, "squeeze.min_variance_retention='high'"),
        ({"min_variance_retention": True}, "squeeze.min_variance_retention=True"),
        ({"target_ranks": [4, 0]}, "squeeze.target_ranks=[4, 0]: must be a list of ranks >= 1"),
        ({"target_ranks": ["4"]}, "squeeze.target_ranks=['4']"),
        ({"target_ranks": 4}, "squeeze.target_ranks=4"),
        ({"compress_to": -1}, "squeeze.compress_to=-1: must be an integer >= 0"),
        ({"compress_to": 2.5}, "squeeze.compress_to=2.5"),
        ({"output_dir": 3}, "squeeze.output_dir=3: must be a path"),
    ],
)
def test_a_squeeze_setting_that_cannot_work_is_named(settings: dict[str, object], named: str) -> None:
    with pytest.raises(SqueezeError) as raised:
        SqueezeSettings.from_mapping(settings)
    assert named in str(raised.value)


def truncate_weights(adapter: Path) -> None:
    weights = adapter / ADAPTER_WEIGHTS
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])


def nan_lora_b(adapter: Path) -> None:
    tensors = load_file(str(adapter / ADAPTER_WEIGHTS))
    key = next(k for k in sorted(tensors) if k.endswith("lora_B.weight"))
    tensors[key][0, 0] = float("nan")
    save_file(tensors, str(adapter / ADAPTER_WEIGHTS), metadata={"format": "pt"})


def edit_config(**changes: object) -> object:
    def edit(adapter: Path) -> None:
        config = json.loads((adapter / "adapter_config.json").read_text())
        (adapter / "adapter_config.json").write_text(json.dumps({**config, **changes}))

    return edit


@pytest.mark.parametrize(
    ("damage", "named"),
    [
        (truncate_weights, r"adapter_model.safetensors: does not read \(SafetensorError"),
        (nan_lora_b, r"lora_B.weight holds NaN or infinite values"),
        (lambda a: (a / "adapter_config.json").write_text('{"r": 8,'), r"adapter_config.json: does not read as JSON"),
        (lambda a: (a / "adapter_config.json").write_text("[8]"), r"adapter_config.json: holds a list, not PEFT's"),
        (edit_config(r=0), r"adapter_config.json: r=0 must be an integer >= 1"),
        (edit_config(r=4), r"adapter_config.json: r=4, but the factors in adapter_model.safetensors have rank 8"),
        (edit_config(lora_alpha="x"), r"adapter_config.json: lora_alpha='x' is not a number"),
    ],
)
def test_a_damaged_adapter_is_one_line(
    adapter: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], damage, named: str
) -> None:
    damage(adapter)
    assert main([str(adapter)]) == 2
    assert main([str(adapter), "--compress-to", "2", "--output", str(tmp_path / "out")]) == 2
    errors = capsys.readouterr().err.splitlines()
    assert len(errors) == 2 and all(line.startswith("retrain squeeze: error: ") for line in errors)
    assert all(re.search(named, line) for line in errors), errors


def test_an_adapter_that_changed_after_it_was_saved_is_refused(
    adapter: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run's final/ records checksums.json: zeroed weights still load, but no longer match their digest."""
    digests = {
        name: hashlib.sha256((adapter / name).read_bytes()).hexdigest()
        for name in ("adapter_config.json", ADAPTER_WEIGHTS)
    }
    (adapter / "checksums.json").write_text(json.dumps(digests))
    assert main([str(adapter)]) == 0
    nan_free = load_file(str(adapter / ADAPTER_WEIGHTS))
    save_file({k: torch.zeros_like(v) for k, v in nan_free.items()}, str(adapter / ADAPTER_WEIGHTS))
    capsys.readouterr()
    assert main([str(adapter)]) == 2
    assert capsys.readouterr().err == (
        f"retrain squeeze: error: {adapter}: adapter_model.safetensors does not match its sha256 in checksums.json "
        "(changed after it was saved)\n"
    )
