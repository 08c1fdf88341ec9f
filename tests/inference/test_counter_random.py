"""The sampler's uniforms are a pure function of (seed, row, position): the same bits however they are asked for."""

from __future__ import annotations

import pytest
import torch

from retrain.inference.sampler.counter_random import CounterUniforms, mix32


def lowbias32(x: int) -> int:
    """The published 32-bit mixer in plain Python integers (uint32 arithmetic)."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_the_tensor_mixer_is_lowbias32_to_the_bit():
    words = torch.randint(0, 2**32, (4096,), generator=torch.Generator().manual_seed(0), dtype=torch.long)
    words[:3] = torch.tensor([0, 1, 2**32 - 1])
    assert mix32(words).tolist() == [lowbias32(int(word)) for word in words]


def test_a_draw_depends_on_its_coordinates_only():
    uniforms = CounterUniforms(seed=1234)
    table = uniforms.table(rows=12, positions=9, device=torch.device("cpu"))
    rows, positions = torch.tensor([7, 0, 11, 7]), torch.tensor([3, 8, 0, 4])
    assert torch.equal(uniforms.uniforms(rows, positions), table[rows, positions])
    # a data-parallel rank holding rows 5.. of the call draws what one process draws for them
    assert torch.equal(CounterUniforms(1234, row_offset=5).table(7, 9, torch.device("cpu")), table[5:])
    assert not torch.equal(CounterUniforms(1235).table(12, 9, torch.device("cpu")), table)


def test_the_uniforms_are_uniform_and_independent_across_rows_and_positions():
    table = CounterUniforms(seed=0).table(rows=512, positions=512, device=torch.device("cpu")).double()
    assert 0 <= float(table.min()) and float(table.max()) < 1
    counts = torch.histc(table, bins=64, min=0, max=1)
    expected = table.numel() / 64
    chi_square = float(((counts - expected) ** 2 / expected).sum())
    assert chi_square < 120  # 63 degrees of freedom: p < 1e-5 above this
    for neighbours in (table[:, 1:] - 0.5) * (table[:, :-1] - 0.5), (table[1:] - 0.5) * (table[:-1] - 0.5):
        assert abs(float(neighbours.mean())) / (1 / 12) < 0.02  # correlation of adjacent positions / rows


def test_seeds_outside_64_bits_are_refused():
    CounterUniforms(2**64 - 1)
    with pytest.raises(ValueError, match="2\\^64"):
        CounterUniforms(-1)
