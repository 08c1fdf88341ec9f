"""Packed groups give the KV-cache way's log-probs and gradients, and are used only where they pay."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import retrain.model.packing as packing_module
from retrain.model.logprobs import completion_logprobs, left_pad
from retrain.model.packing import PACKED_MASK_LIMIT, PackedGroups, packed_hidden
from tests.backend.tiny_model import PROMPTS, encode, make_backend, tokenizer_of


def rows_and_completions(backend, spec, completion_lengths: list[int], prompt_index: list[int]):
    """Left-padded prompts (three, of different lengths) and right-padded completions of the given lengths."""
    prompts, prompt_mask = left_pad(
        encode(backend, PROMPTS[:3]), tokenizer_of(spec.name_or_path).pad_token_id, backend.device
    )
    width = max(completion_lengths)
    generator = torch.Generator().manual_seed(3)
    completions = torch.randint(3, 250, (len(completion_lengths), width), generator=generator)
    completion_mask = torch.arange(width) < torch.tensor(completion_lengths).unsqueeze(1)
    return prompts, prompt_mask, torch.tensor(prompt_index), completions, completion_mask


def logprobs_and_gradient(backend, arguments, packed: bool, monkeypatch) -> tuple[torch.Tensor, torch.Tensor]:
    monkeypatch.setattr(packing_module, "PACKED_SCORE_RATIO", 1_000 if packed else 0)
    backend.model.zero_grad()
    logprobs = completion_logprobs(backend.model, *arguments, 0.8)
    weights = torch.linspace(0.5, 1.5, logprobs.numel(), device=logprobs.device).view_as(logprobs)
    (logprobs * weights).sum().backward()
    return logprobs.detach(), torch.cat([p.grad.flatten().float() for p in backend.trainable])


GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# (log-prob atol, relative gradient difference): the two ways differ in summation order only, so by the
# dtype's rounding (bf16 on CPU measured up to 0.09 on logits of ~10, 0.3% on the gradient)
TOLERANCE = {torch.float32: (2e-5, 1e-5), torch.bfloat16: (0.25, 0.05)}


@pytest.mark.parametrize(
    ("completion_lengths", "prompt_index"),
    [
        ([3, 5, 1, 5, 2, 4], [1, 0, 1, 2, 1, 0]),  # groups of 1-3 rows, rows in no group order
        ([1, 1, 1], [0, 2, 2]),  # one-token completions: only the prompts' last logits
        ([6, 6, 6, 6], [2, 2, 2, 2]),  # one group
    ],
)
@pytest.mark.parametrize(
    ("devices", "dtype"),
    [("cpu", "fp32"), ("cpu", "bf16"), pytest.param("gpu:0", "bf16", marks=GPU)],
)
def test_packed_groups_give_the_kv_cache_way_logprobs_and_gradient(
    tiny_spec, monkeypatch, completion_lengths, prompt_index, devices, dtype
):
    backend = make_backend(replace(tiny_spec, dtype=dtype), devices=devices)
    with torch.no_grad():
        for parameter in backend.trainable:  # an adapter that is not zero, so every LoRA matrix has a gradient
            parameter.add_(torch.randn_like(parameter) * 0.05)
    prompts, prompt_mask, index, completions, completion_mask = rows_and_completions(
        backend, tiny_spec, completion_lengths, prompt_index
    )
    used = sorted(set(prompt_index))
    remap = torch.tensor([used.index(i) if i in used else -1 for i in range(3)])
    arguments = tuple(
        tensor.to(backend.device)
        for tensor in (prompts[used], prompt_mask[used], remap[index], completions, completion_mask)
    )
    packed, packed_gradient = logprobs_and_gradient(backend, arguments, True, monkeypatch)
    kv_cache, kv_cache_gradient = logprobs_and_gradient(backend, arguments, False, monkeypatch)
    logprob_tolerance, gradient_tolerance = TOLERANCE[backend.model.dtype]
    torch.testing.assert_close(packed, kv_cache, atol=logprob_tolerance, rtol=1e-5)
    assert (packed_gradient - kv_cache_gradient).norm() <= gradient_tolerance * kv_cache_gradient.norm()
    assert (packed[~arguments[4]] == 0).all()


def test_packed_hidden_packs_the_rows_it_is_given(tiny_spec, monkeypatch):
    """The result comes from the packed forward (not the KV-cache fallback) while packing pays."""
    backend = make_backend(tiny_spec)
    prompts, prompt_mask, index, completions, completion_mask = rows_and_completions(
        backend, tiny_spec, [2, 3, 3], [0, 0, 1]
    )
    arguments = (backend.model, prompts[:2], prompt_mask[:2], index, completions, completion_mask)
    with torch.no_grad():
        assert packed_hidden(*arguments) is not None
        monkeypatch.setattr(packing_module, "PACKED_SCORE_RATIO", 0)
        assert packed_hidden(*arguments) is None


def layout(prompt_width: int, rows_per_group: int, groups: int, completion_width: int) -> PackedGroups:
    prompt_index = torch.arange(groups).repeat_interleave(rows_per_group)
    return PackedGroups.of(prompt_index, prompt_width, groups, completion_width)


def test_packing_pays_for_short_completions_and_not_for_long_ones():
    quickstart = layout(prompt_width=27, rows_per_group=8, groups=8, completion_width=8)  # ~2.7x the scores
    assert quickstart.pays()
    small64 = layout(prompt_width=31, rows_per_group=8, groups=4, completion_width=64)  # ~5.9x: slower packed
    assert not small64.pays()
    assert not layout(prompt_width=1000, rows_per_group=2, groups=32, completion_width=16).pays()  # mask too big
    assert 32 * (1000 + 2 * 15) ** 2 > PACKED_MASK_LIMIT


def test_slots_columns_and_kept_logits_follow_the_row_order():
    packing = PackedGroups.of(torch.tensor([1, 0, 1, 1]), prompt_width=2, groups=2, completion_width=3)
    assert packing.slot.tolist() == [0, 0, 1, 2]
    assert (packing.slots, packing.width, packing.length) == (3, 2, 8)
    assert packing.columns().tolist() == [[2, 3], [2, 3], [4, 5], [6, 7]]
    # kept logits: the prompt's last position, then the slots' 6 positions; token t > 0 of slot s at s*2 + t
    assert packing.kept(3).tolist() == [[0, 1, 2], [0, 1, 2], [0, 3, 4], [0, 5, 6]]
    attends = packing.attends()
    assert attends[5, :6].tolist() == [True, True, False, False, True, True]  # prompt, own slot, not slot 0
    assert not attends[3, 4]  # nothing later
