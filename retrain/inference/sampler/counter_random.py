"""Uniform random numbers as a pure function of (seed, row, position): what a row samples never depends on
which rows share its batch.

A shared torch.Generator hands out numbers in call order, so a row's draws would change with the batch it
decodes in, and so with the KV budget, preemption or the number of data-parallel ranks. Here each draw is a
hash of its coordinates instead (a counter-based generator, as Philox is): Chris Wellons' `lowbias32`
integer mixer, chained over the seed's two 32-bit words, the row and the position. It runs as plain int64
tensor arithmetic with every product below 2^63 (32-bit products are formed from 16-bit halves), so it
gives the same bits on every device and needs no generator state. Each uniform has 24 random bits, exact in
float32 (the sampler's CDF is float32).

The row is the row's index in the call (prompt index × G + completion index) plus `row_offset`: a
data-parallel rank that samples rows [o, o + n) of a global batch passes o and draws what one process would.
"""

from __future__ import annotations

from typing import TypeVar

import torch

MASK32 = 0xFFFFFFFF
# distinct odd constants xor-ed into each coordinate, so no coordinate hashes its zero to zero
SEED_SALT, ROW_SALT, POSITION_SALT = 0x243F6A88, 0x85A308D3, 0x13198A2E

TABLE_SLICE_ELEMENTS = 2**20  # uniforms hashed per slice of `table`: ~8 MiB for each int64 temporary

Word = TypeVar("Word", int, torch.Tensor)


def mix32(x: Word) -> Word:
    """lowbias32: a 32-bit integer hash with near-ideal avalanche; on ints or int64 tensors of values < 2^32."""
    x = x ^ (x >> 16)
    x = _times(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _times(x, 0x846CA68B)
    return x ^ (x >> 16)


def _times(x: Word, constant: int) -> Word:
    """x · constant mod 2^32 without int64 overflow: the high 16 bits of x multiply only the constant's low half."""
    low, high = x & 0xFFFF, x >> 16
    return (low * constant + ((high * (constant & 0xFFFF)) << 16)) & MASK32


class CounterUniforms:
    """The uniforms of one sampling call: `seed` (any int in [0, 2^64)) and the rows' global offset."""

    def __init__(self, seed: int, row_offset: int = 0) -> None:
        if not 0 <= seed < 2**64:
            raise ValueError(f"a sampling seed must be in [0, 2^64), got {seed}")
        self.key = mix32(mix32((seed & MASK32) ^ SEED_SALT) ^ (seed >> 32))
        self.row_offset = row_offset

    def uniforms(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """float32 uniforms in [0, 1) for the rows with call indices `rows` drawing their token at `positions`
        (integer tensors, broadcast against each other)."""
        row_keys = mix32(self.key ^ mix32(((rows.long() + self.row_offset) & MASK32) ^ ROW_SALT))
        bits = mix32(row_keys ^ mix32((positions.long() & MASK32) ^ POSITION_SALT))
        return (bits >> 8).to(torch.float32) * 2.0**-24

    def table(self, rows: int, positions: int, device: torch.device) -> torch.Tensor:
        """[rows, positions] uniforms of a whole call, computed at once (about forty int64 ops) so that a decode
        step looks its rows' up with one gather instead of hashing: 4 bytes per token, as the call's outputs
        take 21; computed in slices of rows to bound the int64 temporaries."""
        out = torch.empty((rows, positions), dtype=torch.float32, device=device)
        columns = torch.arange(positions, device=device)
        step = max(1, TABLE_SLICE_ELEMENTS // max(positions, 1))
        for start in range(0, rows, step):
            stop = min(rows, start + step)
            out[start:stop] = self.uniforms(torch.arange(start, stop, device=device).unsqueeze(-1), columns)
        return out
