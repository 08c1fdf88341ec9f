"""Rows packed as documents (backend.train_attention=flex): the KV-cache way's log-probs and LoRA gradients, a block
mask that lists exactly the blocks its mask function sees into, and few compiled lengths.

flex_attention has no backward on the CPU, so the gradients are checked through the layout's own mask function made
dense and handed to sdpa; the flex forward itself (eager, and compiled through inductor's CPU template, which visits
only the listed blocks) is checked against the KV-cache way without autograd."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, create_mask

import retrain.model.packing as packing_module
from retrain.backend.local import enable_activation_checkpointing
from retrain.errors import ConfigError
from retrain.model.document_packing import (
    BLOCK,
    DocumentPacking,
    _compiled_flex_attention,
    _training_flex,
    bucket,
    trains_with_documents,
)
from retrain.model.lean_decoder import LeanForward
from retrain.model.logprobs import ForwardTokens, completion_logprobs, head_logprobs, output_head
from retrain.model.rows import rows_of
from tests.backend.tiny_model import make_backend
from tests.inference.test_packing import TOLERANCE, rows_and_completions

CASES = [
    ([3, 5, 1, 5, 2, 4], [1, 0, 1, 2, 1, 0]),  # groups of 1-3 rows, rows in no group order
    ([1, 1, 1], [0, 2, 2]),  # one-token completions: only the prompts' last positions predict
    ([150, 7, 300, 64], [0, 1, 1, 0]),  # completions across several 128-token blocks
]


def adapted_backend(spec, dtype: str = "fp32"):
    backend = make_backend(replace(spec, dtype=dtype))
    with torch.no_grad():
        for parameter in backend.trainable:  # an adapter that is not zero, so every LoRA matrix has a gradient
            parameter.add_(torch.randn_like(parameter) * 0.05)
    return backend


def arguments_of(backend, spec, completion_lengths, prompt_index):
    prompts, prompt_mask, index, completions, completion_mask = rows_and_completions(
        backend, spec, completion_lengths, prompt_index
    )
    used = sorted(set(prompt_index))
    remap = torch.tensor([used.index(i) if i in used else -1 for i in range(3)])
    return prompts[used], prompt_mask[used], remap[index], completions, completion_mask


def kv_cache_way(backend, arguments, monkeypatch) -> tuple[torch.Tensor, torch.Tensor]:
    monkeypatch.setattr(packing_module, "PACKED_SCORE_RATIO", 0)  # no packed groups: a prefill and its cache
    backend.model.zero_grad()
    logprobs = completion_logprobs(backend.model, *arguments, 0.8)
    return logprobs, gradient_of(backend, logprobs)


def gradient_of(backend, logprobs: torch.Tensor) -> torch.Tensor:
    weights = torch.linspace(0.5, 1.5, logprobs.numel(), device=logprobs.device).view_as(logprobs)
    (logprobs * weights).sum().backward()
    return torch.cat([p.grad.flatten().float() for p in backend.trainable])


def documents_through_dense_mask(backend, arguments) -> tuple[torch.Tensor, torch.Tensor]:
    """The document layout's log-probs and gradient, its mask function made dense for sdpa (which has a backward
    on the CPU)."""
    backend.model.zero_grad()
    prompt_ids, prompt_mask, prompt_index, completion_ids, completion_mask = arguments
    packing = DocumentPacking.of(prompt_ids, prompt_mask, prompt_index, completion_ids, completion_mask)
    dense = create_mask(packing.mask_mod(), 1, 1, packing.length, packing.length, device="cpu")
    dense = dense[..., : packing.tokens, : packing.tokens]  # the real tokens'; padding only pads attention's kernel
    hidden = LeanForward.of(backend.model).hidden(packing.input_ids, dense, packing.position_ids, None, 0)
    real = completion_mask.flatten().nonzero().squeeze(1)
    features = rows_of(hidden[0], packing.predicting.flatten()[real])
    values = head_logprobs(output_head(backend.model), features, completion_ids.flatten()[real], 0.8)
    logprobs = torch.zeros(completion_mask.shape).masked_scatter(completion_mask, values)
    return logprobs, gradient_of(backend, logprobs)


@pytest.mark.parametrize(("completion_lengths", "prompt_index"), CASES)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_document_layout_gives_the_kv_cache_way_logprobs_and_lora_gradients(
    tiny_spec, monkeypatch, completion_lengths, prompt_index, dtype
):
    backend = adapted_backend(tiny_spec, dtype)
    arguments = arguments_of(backend, tiny_spec, completion_lengths, prompt_index)
    documents, documents_gradient = documents_through_dense_mask(backend, arguments)
    kv_cache, kv_cache_gradient = kv_cache_way(backend, arguments, monkeypatch)
    logprob_tolerance, gradient_tolerance = TOLERANCE[backend.model.dtype]
    torch.testing.assert_close(documents, kv_cache.detach(), atol=logprob_tolerance, rtol=1e-5)
    assert (documents_gradient - kv_cache_gradient).norm() <= gradient_tolerance * kv_cache_gradient.norm()


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_checkpointed_the_document_layout_recomputes_its_logprobs_and_lora_gradients_to_the_bit(tiny_spec, dtype):
    """Activation checkpointing: each layer of the documents' forward recomputes in backward, the same bits."""
    backend = adapted_backend(tiny_spec, dtype)
    arguments = arguments_of(backend, tiny_spec, *CASES[2])
    plain = documents_through_dense_mask(backend, arguments)
    enable_activation_checkpointing(backend.model)
    assert LeanForward.of(backend.model.train()).checkpointed
    checkpointed = documents_through_dense_mask(backend, arguments)
    assert all(torch.equal(a.detach(), b.detach()) for a, b in zip(checkpointed, plain, strict=True))


@pytest.mark.parametrize(("completion_lengths", "prompt_index"), CASES)
def test_completion_logprobs_through_flex_attention_are_the_kv_cache_ways(
    tiny_spec, monkeypatch, completion_lengths, prompt_index
):
    """The product's path end to end (eager flex_attention on the CPU, without autograd), and its token count."""
    backend = adapted_backend(tiny_spec)
    arguments = arguments_of(backend, tiny_spec, completion_lengths, prompt_index)
    tokens = ForwardTokens()
    with torch.no_grad():
        documents = completion_logprobs(backend.model, *arguments, 0.8, documents=True, tokens=tokens)
        monkeypatch.setattr(packing_module, "PACKED_SCORE_RATIO", 0)
        kv_cache = completion_logprobs(backend.model, *arguments, 0.8)
    torch.testing.assert_close(documents, kv_cache, atol=2e-5, rtol=1e-5)
    prompt_mask, completion_mask = arguments[1], arguments[4]
    real = int(prompt_mask.sum()) + int(completion_mask[:, :-1].sum())  # each prompt once, every input token
    assert tokens.computed == int(tokens.real) == real  # no padding: the kernel's own pads attention alone


def test_the_compiled_kernel_visits_only_the_listed_blocks_and_computes_what_eager_does():
    """Inductor's flex template (here its CPU one) skips the blocks the mask does not list, where eager applies the
    mask function to every key: equal outputs mean the listing misses nothing."""
    packing = packing_of([150, 7, 300, 64, 20], [0, 1, 1, 0, 2], prompt_lengths=[40, 9, 130])
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(1, 4, packing.length, 16, generator=generator)
    key, value = (torch.randn(1, 2, packing.length, 16, generator=generator) for _ in range(2))
    block_mask = packing.block_mask()
    with torch.no_grad():
        eager = _training_flex(query, key, value, block_mask, 0.25)
        compiled = _compiled_flex_attention()(query, key, value, block_mask, 0.25)
    torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-5)


def packing_of(completion_lengths: list[int], prompt_index: list[int], prompt_lengths: list[int]) -> DocumentPacking:
    """A packing of random tokens: prompts of `prompt_lengths` (left-padded), completions of `completion_lengths`."""
    prompt_width, width = max(prompt_lengths), max(completion_lengths)
    prompt_mask = torch.arange(prompt_width) >= prompt_width - torch.tensor(prompt_lengths).unsqueeze(1)
    completion_mask = torch.arange(width) < torch.tensor(completion_lengths).unsqueeze(1)
    prompt_ids = torch.randint(3, 250, prompt_mask.shape) * prompt_mask
    completion_ids = torch.randint(3, 250, completion_mask.shape) * completion_mask
    return DocumentPacking.of(prompt_ids, prompt_mask, torch.tensor(prompt_index), completion_ids, completion_mask)


def test_the_block_mask_lists_exactly_the_blocks_its_mask_function_sees_into():
    packing = packing_of([150, 7, 300, 64, 20, 129], [0, 1, 1, 0, 2, 2], prompt_lengths=[40, 9, 130])
    ours = packing.block_mask()
    blocks = packing.length // BLOCK
    dense = create_block_mask(packing.mask_mod(), 1, 1, packing.length, packing.length, device="cpu")
    expected = dense.to_dense()[0, 0].bool()  # partial and full blocks alike
    assert ours.to_dense()[0, 0].bool().tolist() == expected.tolist()
    assert expected.sum() < blocks * (blocks + 1) // 2  # some causal blocks are skipped: other completions


def test_listed_blocks_grow_with_the_completions_not_with_the_packed_length_squared():
    """A query block sees its prompt and its own completion: the listed blocks (the scores a GPU computes) grow
    linearly with the rows, where a dense mask's grow with their square. Block-aligned here, so exactly: the prompt's
    2 blocks (3 causal pairs), per row its 5 blocks (15 causal pairs) and the prompt (10), per padding block itself."""
    for rows in (4, 8, 16, 64):
        packing = packing_of([641] * rows, [0] * rows, prompt_lengths=[256])
        real_blocks = (256 + rows * 640) // BLOCK
        padding_blocks = packing.length // BLOCK - real_blocks
        assert int(packing.block_mask().kv_num_blocks.sum()) == 3 + 25 * rows + padding_blocks


def test_padded_lengths_come_from_few_buckets_and_waste_under_a_quarter():
    lengths = {bucket(tokens) for tokens in range(1, 10_241)}
    assert len(lengths) <= 24
    assert all(length % BLOCK == 0 for length in lengths)
    assert all(bucket(tokens) < 1.25 * tokens + BLOCK for tokens in range(1, 20_000, 37))


def test_flex_training_attention_is_chosen_only_where_it_can_run(tiny_spec):
    backend = make_backend(tiny_spec)
    cpu = torch.device("cpu")
    assert not trains_with_documents("auto", backend.model, cpu)
    assert not trains_with_documents("mask", backend.model, cpu)
    with pytest.raises(ConfigError, match=r"backend.train_attention=flex needs flex_attention's backward"):
        trains_with_documents("flex", backend.model, cpu)
    with pytest.raises(ConfigError, match="train_attention=flex"):
        make_backend(tiny_spec, train_attention="flex")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(("completion_lengths", "prompt_index"), CASES)
@pytest.mark.parametrize("checkpointing", [False, True])
def test_on_the_gpu_flex_attention_trains_as_the_kv_cache_way(
    tiny_spec, monkeypatch, completion_lengths, prompt_index, checkpointing
):
    """flex_attention's backward, compiled by triton: what the CPU cannot run; checkpointed, recomputed in backward
    (the KV-cache way then runs each row whole: checkpointed layers keep no cache)."""
    backend = make_backend(
        replace(tiny_spec, dtype="bf16"), devices="gpu:0", train_attention="flex", gradient_checkpointing=checkpointing
    )
    assert backend.documents
    arguments = tuple(
        tensor.to(backend.device) for tensor in arguments_of(backend, tiny_spec, completion_lengths, prompt_index)
    )
    backend.model.zero_grad()
    documents = completion_logprobs(backend.model, *arguments, 0.8, documents=True)
    documents_gradient = gradient_of(backend, documents)
    kv_cache, kv_cache_gradient = kv_cache_way(backend, arguments, monkeypatch)
    logprob_tolerance, gradient_tolerance = TOLERANCE[torch.bfloat16]
    torch.testing.assert_close(documents.detach(), kv_cache.detach(), atol=logprob_tolerance, rtol=1e-5)
    assert (documents_gradient - kv_cache_gradient).norm() <= gradient_tolerance * kv_cache_gradient.norm()
