"""One completion asked of the engine by one HTTP request: the unit that the request batcher
(retrain.inference.request_batcher) gathers into a single engine call; it answers with a Completion."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from retrain.inference.completions import Completion
from retrain.types import Rollouts, SamplingParams


@dataclass(frozen=True)
class TokenRequest:
    """A prompt's token ids, its own sampling settings (`max_tokens` is this request's) and its seed (None: drawn)."""

    prompt_ids: list[int]
    sampling: SamplingParams
    seed: int | None


# more(fits): the requests that arrived since last asked and that `fits` accepts, handed over to join a running batch
MoreRequests = Callable[[Callable[[TokenRequest], bool]], list[TokenRequest]]


def completions_of(rollouts: Rollouts) -> list[Completion]:
    """Each row of `rollouts` as a Completion, in row order."""
    out = []
    for n in range(rollouts.num_rows):
        length = int(rollouts.completion_mask[n].sum())
        out.append(
            Completion(
                token_ids=rollouts.completion_ids[n, :length].tolist(),
                logprobs=rollouts.logprobs[n, :length].tolist(),
                hit_max_tokens=bool(rollouts.hit_max_tokens[n]),
            )
        )
    return out
