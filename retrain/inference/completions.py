"""What engines that sample elsewhere (vLLM in-process, vLLM/SGLang/OpenAI-compatible servers) share:
per-prompt seeds derived from the step seed, the stop tokens, and turning per-row token lists into
the padded Rollouts the trainer reads.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import torch

from retrain.model.logprobs import left_pad
from retrain.types import Rollouts, SamplingParams

SEED_BITS = 31  # servers parse seeds as (signed) 32- or 64-bit ints; 31 bits fit every one


@dataclass
class Completion:
    """One sampled completion as an engine returns it."""

    token_ids: list[int]  # EOS included when it stopped on one
    logprobs: list[float]  # the sampler's log-prob of each token (temperature-scaled)
    hit_max_tokens: bool  # stopped by max_tokens, not by a stop token


@dataclass
class SamplingRequest:
    """What every engine sends for one prompt: explicit values, never the server's defaults."""

    prompt_ids: list[int]
    n: int
    sampling: SamplingParams
    seed: int | None
    stop_token_ids: list[int] = field(default_factory=list)


def request_seed(generator_seed: int | None, prompt_index: int) -> int | None:
    """The seed of prompt `prompt_index` in a step: a hash of (step seed, index), so no two prompts
    of any two steps share a random stream (engines seed sample g of a request with seed + g)."""
    if generator_seed is None:
        return None
    digest = hashlib.blake2b(f"{generator_seed}:{prompt_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (2**SEED_BITS - 2**16)  # room for seed + g


def first_prompt(row_offset: int, group_size: int) -> int:
    """The global index of a call's first prompt from its first row's (`row_offset`, see
    InferenceEngine.generate): a data-parallel rank's share then seeds each prompt as the whole batch would."""
    if row_offset < 0 or row_offset % group_size:
        raise ValueError(f"row_offset={row_offset} is not the first row of a group of {group_size}")
    return row_offset // group_size


def stop_token_ids(tokenizer: Any, generation_config: Any = None) -> list[int]:
    """Every id that ends a completion: the tokenizer's EOS plus the model's generation-config EOS list
    (chat models such as Qwen end turns with <|im_end|>, which may differ from the tokenizer's EOS)."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    configured = getattr(generation_config, "eos_token_id", None)
    if isinstance(configured, int):
        ids.add(configured)
    elif configured:
        ids.update(int(i) for i in configured)
    return sorted(ids)


def rollouts_from_completions(
    prompt_ids: list[list[int]],
    completions: list[Completion],
    group_size: int,
    sampling: SamplingParams,
    tokenizer: Any,
) -> Rollouts:
    """Pad B×G completions (group-major) into Rollouts on the CPU, texts decoded as the PyTorch engine does."""
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    prompts, prompt_mask = left_pad(prompt_ids, pad_id, torch.device("cpu"))
    rows = len(completions)
    width = max(1, max(len(c.token_ids) for c in completions))
    ids = torch.full((rows, width), pad_id, dtype=torch.long)
    mask = torch.zeros((rows, width), dtype=torch.bool)
    logprobs = torch.zeros((rows, width), dtype=torch.float32)
    for row, completion in enumerate(completions):
        length = len(completion.token_ids)
        if len(completion.logprobs) != length:
            raise ValueError(
                f"completion {row} has {length} tokens but {len(completion.logprobs)} log-probs: "
                "the engine must return one log-prob per sampled token"
            )
        ids[row, :length] = torch.tensor(completion.token_ids, dtype=torch.long)
        mask[row, :length] = True
        logprobs[row, :length] = torch.tensor(completion.logprobs, dtype=torch.float32)
    return Rollouts(
        prompt_ids=prompts,
        prompt_mask=prompt_mask,
        completion_ids=ids,
        completion_mask=mask,
        logprobs=logprobs,
        texts=tokenizer.batch_decode([c.token_ids for c in completions], skip_special_tokens=True),
        group_size=group_size,
        hit_max_tokens=torch.tensor([c.hit_max_tokens for c in completions], dtype=torch.bool),
        temperature=sampling.temperature,
    )
