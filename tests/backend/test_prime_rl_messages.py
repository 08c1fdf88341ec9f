"""PRIME-RL's rollout messages on the wire: field order pinned to PRIME-RL v0.8.1.dev67 (commit 559b44772e47,
src/prime_rl/transports/rollouts/types.py), real msgpack round trips, and the packing of a TrainBatch."""

from __future__ import annotations

import msgspec
import pytest

from retrain.backend.prime_rl.messages import MicroBatch, TrainingSample, decode_rank, encode_rank
from retrain.backend.prime_rl.packing import pack, row_samples
from retrain.errors import ConfigError
from tests.backend.prime_rl_helpers import train_batch

# copied from PRIME-RL's types.py: an array_like struct is decoded by position, so this order IS the protocol
PRIME_RL_MICRO_BATCH_FIELDS = (
    "input_ids",
    "loss_mask",
    "advantages",
    "inference_logprobs",
    "position_ids",
    "sequence_lengths",
    "temperatures",
    "env_names",
    "seq_lens",
    "ref_logprobs",
    "routed_experts",
    "mm_kwargs",
    "mm_token_type_ids",
    "rl_weights",
    "ce_weights",
    "ref_kl_weights",
)
PRIME_RL_TRAINING_SAMPLE_FIELDS = (
    "token_ids",
    "mask",
    "logprobs",
    "temperatures",
    "env_name",
    "ref_logprobs",
    "mm_kwargs",
    "routed_experts",
    "mm_token_type_ids",
    "rl_weights",
    "ce_weights",
    "ref_kl_weights",
    "advantages",
)


def test_field_order_is_prime_rls():
    assert MicroBatch.__struct_fields__ == PRIME_RL_MICRO_BATCH_FIELDS
    assert TrainingSample.__struct_fields__ == PRIME_RL_TRAINING_SAMPLE_FIELDS
    for struct in (MicroBatch, TrainingSample):
        assert struct.__struct_config__.array_like and struct.__struct_config__.omit_defaults


def test_micro_batches_round_trip_and_sit_at_prime_rls_positions():
    micro_batch = MicroBatch(
        input_ids=[1, 2, 3],
        loss_mask=[False, True, True],
        advantages=[0.0, 0.5, 0.5],
        inference_logprobs=[0.0, -0.25, -0.5],
        position_ids=[0, 1, 2],
        sequence_lengths=[3],
        temperatures=[0.7, 0.7, 0.7],
        env_names=["retrain"] * 3,
        seq_lens=[3],
    )
    payload = encode_rank([micro_batch, micro_batch])
    assert decode_rank(payload) == [micro_batch, micro_batch]
    raw = msgspec.msgpack.decode(payload)  # untyped: what position each field travels at
    assert raw[0][:9] == [[1, 2, 3], [False, True, True], [0.0, 0.5, 0.5], [0.0, -0.25, -0.5], [0, 1, 2], [3],
                      [0.7, 0.7, 0.7], ["retrain"] * 3, [3]]  # fmt: skip
    assert raw[0][9:] == [None] * 7  # the optional fields, unset
    assert decode_rank(payload)[0].rl_weights is None and decode_rank(payload)[0].routed_experts is None


def test_rows_become_samples_with_their_completion_tokens_advantages():
    samples = row_samples(train_batch())
    assert len(samples) == 3  # row 3 is not in row_mask
    first = samples[0]
    assert first.token_ids == [11, 12, 31, 32]  # left padding and right padding gone
    assert first.mask == [False, False, True, True]
    assert first.logprobs == [0.0, 0.0, -0.5, -0.25]
    assert first.advantages == [0.0, 0.0, 0.5, 0.5]
    assert first.temperatures == pytest.approx([0.7] * 4)
    assert samples[1].advantages == [0.0, 0.0, -0.5, -0.5, -0.5]  # row 1: prompt 0's second completion
    assert samples[2].token_ids == [21, 22, 23, 51]


def test_token_varying_advantages_travel_token_by_token():
    """GTPO/HICRA/SEPA credit reaches PRIME-RL's per-token loss as computed, nothing averaged (row 1's padding
    position carries 0 in the batch and is not sent)."""
    varying = [[0.5, 0.25, 0.0], [-0.75, 0.125, -0.5], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    samples = row_samples(train_batch(varying))
    assert [sample.advantages for sample in samples] == [
        [0.0, 0.0, 0.5, 0.25],
        [0.0, 0.0, -0.75, 0.125, -0.5],
        [0.0, 0.0, 0.0, 1.0],
    ]


def test_packing_fills_micro_batches_and_gives_every_rank_as_many():
    samples = row_samples(train_batch())  # 4 + 5 + 4 tokens
    (only,) = pack(samples, seq_len=16, num_ranks=1)
    assert len(only) == 1 and only[0].sequence_lengths == [5, 4, 4] and only[0].seq_lens == [5, 4, 4]
    assert only[0].position_ids == [0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 2, 3]
    assert sum(only[0].loss_mask) == 2 + 3 + 1
    grid = pack(samples, seq_len=8, num_ranks=4)
    assert [len(rank) for rank in grid] == [1, 1, 1, 1]
    trained = [mb for rank in grid for mb in rank if any(mb.loss_mask)]
    assert sorted(sum(mb.sequence_lengths) for mb in trained) == [5, 8]
    with pytest.raises(ConfigError, match="backend.seq_len=4"):
        pack(samples, seq_len=4, num_ranks=1)
