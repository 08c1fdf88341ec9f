"""The build script is reproducible: the same command writes the same weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from transformers import AutoModelForCausalLM, AutoTokenizer

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "build_tiny_model.py"
CHEAP = ["--max-steps", "3", "--eval-every", "0", "--eval-size", "16"]


def build(out: Path) -> str:
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), *CHEAP],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_same_command_writes_identical_weights(tmp_path: Path) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    report = build(first)
    build(second)
    assert (first / "model.safetensors").read_bytes() == (second / "model.safetensors").read_bytes()
    assert (first / "tokenizer.json").read_bytes() == (second / "tokenizer.json").read_bytes()
    assert "held-out (16) greedy accuracy" in report

    info = json.loads((first / "build_info.json").read_text())
    assert info["steps"] == 3 and info["build_args"]["max_steps"] == 3
    assert AutoTokenizer.from_pretrained(first).eos_token == "<|im_end|>"
    assert AutoModelForCausalLM.from_pretrained(first).config.model_type == "qwen3"
