"""The freshness proof: after every sync, the engine must score a fixed probe as the trainer does.

The probe is a short fixed text split into a prompt and a continuation. The engine scores the
continuation through its own sampling path (for the PyTorch engine: prefill, then cached decode
steps), the backend through its training forward, both at T = 1 under the weights just trained.
An engine still serving older weights (an adapter never reloaded, a stale KV cache) scores it
differently, and the run stops with StaleWeightsError instead of training on off-policy rollouts.
Scoring uses no randomness, so the proof never shifts a run's random streams.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from retrain.backend.base import Backend
from retrain.inference.base import InferenceEngine, StaleWeightsError

PROBE_TEXT = "retrain weight probe: 3 + 4 = 7."
PROBE_CONTINUATION_TOKENS = 2
PROBE_TOLERANCE_FP32 = 1e-3  # max mean |Δ log-prob| between the two paths in float32
PROBE_TOLERANCE_HALF = 0.1  # and in bf16/fp16


@dataclass(frozen=True)
class Probe:
    """A prompt and the continuation whose token log-probs both sides compute."""

    prompt_ids: list[int]
    completion_ids: list[int]

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> Probe:
        token_ids = list(tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"])
        return cls(
            prompt_ids=token_ids[:-PROBE_CONTINUATION_TOKENS], completion_ids=token_ids[-PROBE_CONTINUATION_TOKENS:]
        )


def probe_tolerance(dtype: torch.dtype) -> float:
    """How far the engine's and the trainer's numerics may drift apart in `dtype` and still agree."""
    return PROBE_TOLERANCE_FP32 if dtype == torch.float32 else PROBE_TOLERANCE_HALF


def check_fresh(engine: InferenceEngine, backend: Backend, probe: Probe, version: int) -> float:
    """Mean |engine − trainer| log-prob on the probe; StaleWeightsError when it is over the tolerance."""
    served = engine.probe_logprobs(probe).float().cpu()
    trained = backend.probe_logprobs(probe).float().cpu()
    gap = float((served - trained).abs().mean())
    if not gap <= backend.probe_tolerance:
        raise StaleWeightsError(
            f"the inference engine serves stale weights: after the sync to weights version "
            f"{version}, its log-probs on the probe differ from the trainer's by {gap:.3g} "
            f"(tolerance {backend.probe_tolerance})"
        )
    return gap
