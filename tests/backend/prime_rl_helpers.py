"""What the PRIME-RL backend tests share: a small TrainBatch, free loopback ports, and a broadcast
written as PRIME-RL's trainer writes it (a PEFT adapter of the tiny model, then the STABLE marker)."""

from __future__ import annotations

import socket
from pathlib import Path

import torch

from retrain.backend.prime_rl.backend import PrimeRlBackend
from retrain.backend.prime_rl.config import PrimeRlBackendConfig
from retrain.backend.prime_rl.weights import STABLE
from retrain.backend.settings import LossSettings, OptimSettings
from retrain.config import TrainingConfig
from retrain.model.spec import ModelSpec
from retrain.types import Rollouts, TrainBatch

SPEC = ModelSpec(name_or_path="retrain:tiny_qwen3", lora_rank=4)


def make_backend(output_dir: Path | str, **options) -> PrimeRlBackend:
    training = TrainingConfig()
    return PrimeRlBackend(
        PrimeRlBackendConfig(output_dir=str(output_dir), **options),
        model=SPEC,
        optim=OptimSettings.from_config(training),
        loss=LossSettings.from_config(training),
        seed=0,
    )


def train_batch(advantages: list[list[float]] | None = None, temperature: float = 0.7) -> TrainBatch:
    """2 prompts × 2 completions; row 3 is dropped by row_mask. Prompt 0 is left-padded by one token."""
    rollouts = Rollouts(
        prompt_ids=torch.tensor([[0, 11, 12], [21, 22, 23]]),
        prompt_mask=torch.tensor([[False, True, True], [True, True, True]]),
        completion_ids=torch.tensor([[31, 32, 0], [41, 42, 43], [51, 0, 0], [61, 62, 0]]),
        completion_mask=torch.tensor(
            [[True, True, False], [True, True, True], [True, False, False], [True, True, False]]
        ),
        logprobs=torch.tensor([[-0.5, -0.25, 0.0], [-1.0, -2.0, -3.0], [-0.125, 0.0, 0.0], [-1.0, -1.0, 0.0]]),
        texts=["a", "b", "c", "d"],
        group_size=2,
        hit_max_tokens=torch.zeros(4, dtype=torch.bool),
        temperature=temperature,
    )
    values = advantages or [[0.5, 0.5, 0.0], [-0.5, -0.5, -0.5], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    advantage = torch.tensor(values) * rollouts.completion_mask
    return TrainBatch(rollouts=rollouts, advantages=advantage, row_mask=torch.tensor([True, True, True, False]))


def free_port_pair() -> int:
    """A loopback port p with p + 1 free too (the ZMQ data and READY sockets)."""
    for _ in range(100):
        with socket.socket() as first:
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            with socket.socket() as second:
                try:
                    second.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
                return port
    raise RuntimeError("no free pair of loopback ports")


def write_broadcast(directory: Path, seed: int) -> Path:
    """A LoRA broadcast of the tiny model (lora_B drawn from `seed`, so the weights differ from the
    base model's), written as PRIME-RL's trainer writes it: the files first, STABLE last."""
    model = SPEC.load_lora_model(torch.device("cpu"), seed)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(0.2 * torch.randn(parameter.shape, generator=generator))
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(directory))
    (directory / STABLE).touch()
    return directory
