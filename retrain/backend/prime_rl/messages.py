"""PRIME-RL's rollout messages, field for field (msgspec Structs encoded as msgpack arrays).

Copied from src/prime_rl/transports/rollouts/types.py of PRIME-RL v0.8.1.dev67 (commit
559b44772e471d1538537b8805cc77f3824a5e64, 2026-08-21). The structs are `array_like`: a field is
identified by its POSITION on the wire, so the order, the types and the defaults must stay exactly
PRIME-RL's (tests/backend/test_prime_rl_messages.py pins them); unset optional fields travel as nil.

What crosses the transport is one `list[MicroBatch]` per trainer data rank and step: the
orchestrator packs its `TrainingSample`s (one per rollout branch) into micro-batches of at most
`seq_len` tokens (packing.py). Earlier PRIME-RL releases (Dec 2025 - Aug 2026) sent a
`TrainingBatch(examples: list[TrainingSample], step, run_idx)` to a packer inside the trainer; PRIME-RL
removed it with the multi-tenant trainer (#3189), so retrain speaks the current protocol only.
Importing this module needs msgspec (`pip install 'retrain[prime_rl]'`).
"""

from __future__ import annotations

import msgspec


class EncodedTensor(msgspec.Struct, array_like=True, gc=False):
    """{dtype, shape, raw bytes} of a multimodal tensor (retrain sends none)."""

    dtype: str
    shape: list[int]
    data: bytes


class RoutedExperts(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    """MoE routing replay data (retrain sends none)."""

    data: bytes
    shape: list[int]  # [seq_len, layers, topk]
    dtype: str


class TrainingSample(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    """One rollout branch as a flat token sequence; every per-token list has the length of token_ids."""

    token_ids: list[int]
    mask: list[bool]  # trainable (model-sampled) tokens
    logprobs: list[float]  # the sampler's, 0 on the prompt
    temperatures: list[float]
    env_name: str
    ref_logprobs: list[float] | None = None
    mm_kwargs: dict[str, EncodedTensor] | None = None
    routed_experts: RoutedExperts | None = None
    mm_token_type_ids: list[int] | None = None
    rl_weights: list[float] | None = None
    ce_weights: list[float] | None = None
    ref_kl_weights: list[float] | None = None
    advantages: list[float] | None = None  # the rollout's scalar broadcast over its completion


class MicroBatch(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    """Packed samples for one forward of a trainer rank (orchestrator -> trainer)."""

    input_ids: list[int]
    loss_mask: list[bool]
    advantages: list[float]
    inference_logprobs: list[float]
    position_ids: list[int]  # restart at 0 for every packed sample
    sequence_lengths: list[int]
    temperatures: list[float]
    env_names: list[str]  # per token
    seq_lens: list[int]
    ref_logprobs: list[float] | None = None
    routed_experts: RoutedExperts | None = None
    mm_kwargs: dict[str, EncodedTensor] | None = None
    mm_token_type_ids: list[int] | None = None
    rl_weights: list[float] | None = None
    ce_weights: list[float] | None = None
    ref_kl_weights: list[float] | None = None


def encode_rank(micro_batches: list[MicroBatch]) -> bytes:
    """The bytes of one rank's step, as PRIME-RL's sender writes them (msgpack of list[MicroBatch])."""
    return msgspec.msgpack.encode(micro_batches)


def decode_rank(payload: bytes) -> list[MicroBatch]:
    """What PRIME-RL's trainer decodes from those bytes."""
    return msgspec.msgpack.decode(payload, type=list[MicroBatch])
