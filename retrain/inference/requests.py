"""One completion asked of the engine by one HTTP request, and what comes back: the unit that the request batcher
(retrain.inference.request_batcher) gathers into a single engine call."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from retrain.types import Rollouts, SamplingParams


@dataclass(frozen=True)
class TokenRequest:
    """A prompt's token ids, its own sampling settings (`max_tokens` is this request's) and its seed (None: drawn)."""

    prompt_ids: list[int]
    sampling: SamplingParams
    seed: int | None


@dataclass(frozen=True)
class TokenCompletion:
    """The sampled token ids, the sampler's log-prob of each, and whether max_tokens cut the completion."""

    token_ids: list[int]
    logprobs: list[float]
    hit_max_tokens: bool


# more(fits): the requests that arrived since last asked and that `fits` accepts, handed over to join a running batch
MoreRequests = Callable[[Callable[[TokenRequest], bool]], list[TokenRequest]]


def completions_of(rollouts: Rollouts) -> list[TokenCompletion]:
    """Each row of `rollouts` as a TokenCompletion, in row order."""
    out = []
    for n in range(rollouts.num_rows):
        length = int(rollouts.completion_mask[n].sum())
        out.append(
            TokenCompletion(
                token_ids=rollouts.completion_ids[n, :length].tolist(),
                logprobs=rollouts.logprobs[n, :length].tolist(),
                hit_max_tokens=bool(rollouts.hit_max_tokens[n]),
            )
        )
    return out
