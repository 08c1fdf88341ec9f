"""The probe both sides score after every sync, and what counts as the engine serving stale weights.

The probe is a short fixed text split into a prompt and a continuation. The engine scores the
continuation through the weights it samples with, the backend through its own weights, both at T = 1
(retrain.training.freshness compares the two). Scoring uses no randomness, so the proof never shifts
a run's random streams.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from retrain.errors import UserError
from retrain.model.lean_decoder import causal_lm_logits
from retrain.model.logprobs import scaled_log_softmax
from retrain.plugins import PluginOutputError, check_shape

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

    def logprobs_under(self, model: Any, device: torch.device) -> torch.Tensor:
        """The continuation's log-probs at T = 1 from one forward of prompt and continuation through `model`
        as it is (the caller picks eval mode, inference mode and the weights). An in-process engine and its
        backend both score this way, so they agree to the bit unless their weights differ (two different
        forwards drifted apart in bf16 as far as one update moves the probe)."""
        ids = torch.tensor([self.prompt_ids + self.completion_ids[:-1]], device=device)
        continuation = torch.tensor(self.completion_ids, device=device)
        logits = causal_lm_logits(model, ids, logits_to_keep=len(continuation))[0]
        return scaled_log_softmax(logits, 1.0).gather(-1, continuation.unsqueeze(-1)).squeeze(-1)


def probe_tolerance(dtype: torch.dtype) -> float:
    """How far the engine's and the trainer's numerics may drift apart in `dtype` and still agree."""
    return PROBE_TOLERANCE_FP32 if dtype == torch.float32 else PROBE_TOLERANCE_HALF


class StaleWeightsError(UserError, RuntimeError):
    """The engine cannot show that it serves the weights of the version it was asked to sync to.

    Silently stale sampler weights make every rollout off-policy without any visible error, so the
    run stops with this error instead of carrying on.
    """


def check_probe_logprobs(logprobs: Any, what: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    """The contract of `probe_logprobs`: one finite log-prob (<= 0) per completion token of the probe."""
    probe = args[0]
    value = check_shape(logprobs, (len(probe.completion_ids),), what=f"{what}.probe_logprobs")
    if not all(math.isfinite(x) and x <= 1e-6 for x in value.tolist()):
        raise PluginOutputError(f"{what}.probe_logprobs returned {value.tolist()}, expected finite log-probs <= 0")
    return value
