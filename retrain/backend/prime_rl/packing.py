"""A step's TrainBatch as PRIME-RL micro-batches: one TrainingSample per trained row, packed per trainer rank.

This is the work PRIME-RL's orchestrator does before it sends (its train sink builds the samples,
`prime_rl.trainer.batch.prepare_batch` packs them): a row becomes prompt + completion tokens, the loss
mask and the sampler's log-probs on the completion only, the sampling temperature on every token, and
and each completion token's own advantage (PRIME-RL's loss takes advantages per token, so token-level
credit such as GTPO, HICRA or SEPA arrives intact).
Samples are packed first-fit-decreasing into micro-batches of at most `seq_len` tokens (position ids
restart per sample); every rank gets the same number of micro-batches (zero-loss copies fill the
gap, as PRIME-RL pads), balanced by token count. Rows longer than `seq_len` are refused rather than
truncated as PRIME-RL would, so no completion is silently cut.
"""

from __future__ import annotations

import copy

from retrain.backend.prime_rl.messages import MicroBatch, TrainingSample
from retrain.errors import ConfigError
from retrain.types import TrainBatch

ENV_NAME = "retrain"  # the env name PRIME-RL's metrics group the samples under


def row_samples(batch: TrainBatch) -> list[TrainingSample]:
    """The rows of `row_mask` as PRIME-RL TrainingSamples (rows without completion tokens are left out)."""
    rollouts = batch.rollouts
    if rollouts.temperature <= 0:
        raise ValueError("greedy rollouts (temperature 0) have no sampling distribution to train on")
    temperature = float(rollouts.temperature)
    samples = []
    for row in batch.row_mask.nonzero().flatten().tolist():
        prompt_row = row // rollouts.group_size
        prompt = rollouts.prompt_ids[prompt_row][rollouts.prompt_mask[prompt_row]].tolist()
        completion_mask = rollouts.completion_mask[row]
        completion = rollouts.completion_ids[row][completion_mask].tolist()
        if not completion:
            continue
        advantages = batch.advantages[row][completion_mask].float().tolist()
        n_prompt, n_completion = len(prompt), len(completion)
        samples.append(
            TrainingSample(
                token_ids=prompt + completion,
                mask=[False] * n_prompt + [True] * n_completion,
                logprobs=[0.0] * n_prompt + rollouts.logprobs[row][completion_mask].float().tolist(),
                temperatures=[temperature] * (n_prompt + n_completion),
                env_name=ENV_NAME,
                advantages=[0.0] * n_prompt + advantages,
            )
        )
    return samples


def pack(samples: list[TrainingSample], seq_len: int, num_ranks: int) -> list[list[MicroBatch]]:
    """`samples` as one list of micro-batches per rank, every list of the same length."""
    singles = [_single(sample, seq_len) for sample in samples]
    bins: list[list[MicroBatch]] = []
    lengths: list[int] = []
    for single in sorted(singles, key=lambda mb: -len(mb.input_ids)):
        size = len(single.input_ids)
        fit = next((i for i, used in enumerate(lengths) if used + size <= seq_len), None)
        if fit is None:
            bins.append([single])
            lengths.append(size)
        else:
            bins[fit].append(single)
            lengths[fit] += size
    packed = [_concatenate(members) for members in bins]
    while len(packed) % num_ranks or not packed:
        packed.append(_zero_loss_copy(packed[0]))
    per_rank = len(packed) // num_ranks
    grid: list[list[MicroBatch]] = [[] for _ in range(num_ranks)]
    load = [0] * num_ranks
    for micro_batch in sorted(packed, key=lambda mb: -len(mb.input_ids)):
        rank = min((r for r in range(num_ranks) if len(grid[r]) < per_rank), key=lambda r: load[r])
        grid[rank].append(micro_batch)
        load[rank] += len(micro_batch.input_ids)
    return grid


def _single(sample: TrainingSample, seq_len: int) -> MicroBatch:
    length = len(sample.token_ids)
    if length > seq_len:
        raise ConfigError(
            f"backend.seq_len={seq_len} is shorter than a trained row ({length} tokens: prompt + completion); "
            "raise it to the PRIME-RL orchestrator's seq_len, or lower training.max_tokens"
        )
    assert sample.advantages is not None
    return MicroBatch(
        input_ids=list(sample.token_ids),
        loss_mask=list(sample.mask),
        advantages=list(sample.advantages),
        inference_logprobs=list(sample.logprobs),
        position_ids=list(range(length)),
        sequence_lengths=[length],
        temperatures=list(sample.temperatures),
        env_names=[sample.env_name] * length,
        seq_lens=[length],
    )


def _concatenate(members: list[MicroBatch]) -> MicroBatch:
    def joined(name: str) -> list:
        return [value for member in members for value in getattr(member, name)]

    return MicroBatch(
        input_ids=joined("input_ids"),
        loss_mask=joined("loss_mask"),
        advantages=joined("advantages"),
        inference_logprobs=joined("inference_logprobs"),
        position_ids=joined("position_ids"),
        sequence_lengths=joined("sequence_lengths"),
        temperatures=joined("temperatures"),
        env_names=joined("env_names"),
        seq_lens=joined("seq_lens"),
    )


def _zero_loss_copy(source: MicroBatch) -> MicroBatch:
    """A micro-batch that trains nothing, for a rank that would otherwise have fewer micro-batches."""
    dummy = copy.deepcopy(source)
    dummy.advantages = [0.0] * len(dummy.input_ids)
    dummy.loss_mask = [False] * len(dummy.input_ids)
    return dummy


def trained_tokens(samples: list[TrainingSample]) -> int:
    return sum(sum(sample.mask) for sample in samples)
