"""One real training step (sampling, then training) on the CPU, its peak memory measured: run as
`python -m tests.memory_probe '<json settings>'` in a fresh process, it prints one JSON line.

On the CPU: peak resident memory (VmHWM) over a baseline taken after the imports; /proc/self/clear_refs
resets the high-water mark between phases, so each phase's peak is measured on its own. Run it with
MALLOC_MMAP_THRESHOLD_=65536: glibc then maps every allocation of 64 KiB or more on its own and unmaps it when
freed, so resident memory follows what torch holds instead of what glibc's heap kept. On a GPU
(`"device": "gpu:0"`): torch.cuda.max_memory_allocated over what was allocated before the model loaded.
tests/test_memory_plan.py compares these with the memory plan.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from retrain.backend.config import LocalBackendConfig
from retrain.backend.local import LocalBackend
from retrain.backend.settings import LossSettings, OptimSettings
from retrain.config import TrainingConfig
from retrain.inference.config import PytorchEngineConfig
from retrain.inference.pytorch import PytorchEngine
from retrain.model.spec import ModelSpec
from retrain.types import SamplingParams, TrainBatch

STATUS = Path("/proc/self/status")


def resident(field: str) -> int:
    """VmRSS or VmHWM of this process, in bytes."""
    for line in STATUS.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in {STATUS}")


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark restarts from the current RSS


def main(settings: dict) -> dict:
    torch.manual_seed(0)
    device = settings.get("device", "cpu")
    on_gpu = device.startswith("gpu")
    baseline = torch.cuda.memory_allocated() if on_gpu else resident("VmRSS")
    options = {"devices": device, "micro_batch_tokens": settings["micro_batch_tokens"]}
    options["gradient_checkpointing"] = settings["gradient_checkpointing"]
    training = TrainingConfig()
    backend = LocalBackend(
        LocalBackendConfig(**options),
        ModelSpec(name_or_path=settings["model"], dtype=settings.get("dtype", "fp32"), lora_rank=settings["lora_rank"]),
        OptimSettings.from_config(training),
        LossSettings.from_config(training),
        seed=0,
    )
    tokenizer = backend.spec.load_tokenizer()
    engine = PytorchEngine(
        PytorchEngineConfig(kv_cache_gb=settings.get("kv_cache_gb", 0.0)), tokenizer, backend.engine_resources()
    )
    stops = set(engine.eos_ids.tolist()) | {engine.pad_id}
    allowed = torch.tensor([i for i in range(len(tokenizer)) if i not in stops])
    prompts = [
        allowed[torch.randint(len(allowed), (settings["prompt_tokens"],))].tolist()
        for _ in range(settings["batch_size"])
    ]
    sampling = SamplingParams(max_tokens=settings["max_tokens"], temperature=1.0)
    peak = torch.cuda.max_memory_allocated if on_gpu else (lambda: resident("VmHWM"))
    reset = torch.cuda.reset_peak_memory_stats if on_gpu else reset_peak
    reset()
    rollouts = engine.generate(prompts, settings["group_size"], sampling, generator_seed=0)
    sampling_peak = peak()
    advantages = torch.where(torch.rand(rollouts.completion_mask.shape) < 0.5, -1.0, 1.0) * rollouts.completion_mask
    batch = TrainBatch(rollouts, advantages, torch.ones(rollouts.completion_mask.shape[0], dtype=torch.bool))
    reset()
    backend.train(batch)
    training_peak = peak()
    return {
        "baseline": baseline,
        "sampling_peak": sampling_peak - baseline,
        "training_peak": training_peak - baseline,
        "completion_width": int(rollouts.completion_mask.shape[1]),
        "completion_tokens": int(rollouts.completion_mask.sum()),
    }


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
