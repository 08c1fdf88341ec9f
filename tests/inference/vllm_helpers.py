"""What the vLLM engine tests share: the model, the sampling, an engine starter and the trainer's side of a step."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from retrain.inference.base import ENGINE_CHECKS
from retrain.inference.config import VllmEngineConfig
from retrain.inference.vllm import VllmEngine
from retrain.model.logprobs import completion_logprobs
from retrain.model.spec import ModelSpec
from retrain.plugins import Checked
from retrain.types import Rollouts, SamplingParams, TrainBatch, TrainResult
from tests.backend.tiny_model import tokenizer_of

SPEC = ModelSpec(name_or_path="retrain:tiny_qwen3", lora_rank=4)
SAMPLED = SamplingParams(max_tokens=8, temperature=0.7, top_p=1.0)


def started_engine(backend, **options) -> Iterator[Checked]:
    """A VllmEngine beside `backend`, every generate and probe checked against the engine contract; closed after."""
    set_num_threads = torch.set_num_threads  # vLLM's CPU worker swaps in a no-op for the whole process
    engine = VllmEngine(
        VllmEngineConfig(**options), tokenizer=tokenizer_of(SPEC.name_or_path), resources=backend.engine_resources()
    )
    yield Checked(engine, ENGINE_CHECKS, "inference=vllm")
    engine.close()
    torch.set_num_threads = set_num_threads  # the test modules after this one set threads for real


def trainer_logprobs(backend, rollouts: Rollouts, temperature: float) -> torch.Tensor:
    """[R, T] log-probs of the sampled tokens under the backend's HF+PEFT model (row r continues prompt r // G)."""
    backend.model.eval()
    prompt_index = torch.arange(rollouts.num_rows) // rollouts.group_size
    with torch.no_grad():
        return completion_logprobs(
            backend.model,
            rollouts.prompt_ids,
            rollouts.prompt_mask,
            prompt_index,
            rollouts.completion_ids,
            rollouts.completion_mask,
            temperature,
        )


def train_on(backend, rollouts: Rollouts) -> TrainResult:
    """One real optimizer step of the backend on `rollouts`, with random advantages."""
    advantages = torch.randn(rollouts.completion_ids.shape, generator=torch.Generator().manual_seed(0))
    row_mask = torch.ones(rollouts.num_rows, dtype=torch.bool)
    return backend.train(TrainBatch(rollouts, advantages * rollouts.completion_mask, row_mask))
