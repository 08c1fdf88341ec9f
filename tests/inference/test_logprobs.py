"""The training-side log-prob forward: padding-invariant, and the same with or without shared prompts."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from retrain.housekeeping.determinism import reproducible_torch
from retrain.model.cache_argument import with_cache
from retrain.model.logprobs import completion_logprobs, left_pad, select_rows
from retrain.model.rows import rows_of
from tests.backend.tiny_model import PROMPTS, encode, make_backend, tokenizer_of


def test_shared_prompt_cache_gives_the_one_forward_logprobs_and_gradient(tiny_spec):
    backend = make_backend(tiny_spec)
    prompt_ids = encode(backend, PROMPTS[:3])
    prompts, prompt_mask = left_pad(prompt_ids, tokenizer_of(tiny_spec.name_or_path).pad_token_id, backend.device)
    completions, completion_mask = left_pad([[5, 6, 7], [8, 9, 10], [11, 12, 13], [14, 15, 16]], 0, backend.device)
    completions, completion_mask = completions.flip(1), completion_mask.flip(1)  # right-padded
    completion_mask[1, 2] = False
    prompt_index = torch.tensor([0, 0, 2, 1])
    results = []
    for share in (True, False):
        backend.model.zero_grad()
        logprobs = completion_logprobs(
            backend.model, prompts, prompt_mask, prompt_index, completions, completion_mask, 0.7, share_prompts=share
        )
        logprobs.sum().backward()
        grads = [p.grad.clone() for p in backend.trainable]
        results.append((logprobs.detach(), grads))
    torch.testing.assert_close(results[0][0], results[1][0], atol=1e-5, rtol=1e-5)
    shared, separate = (torch.cat([g.flatten() for g in grads]) for grads in (results[0][1], results[1][1]))
    assert (shared - separate).norm() <= 1e-5 * separate.norm()  # fp32 summation order only
    assert (results[0][0][~completion_mask] == 0).all()


def test_extra_left_padding_does_not_change_logprobs(tiny_spec):
    backend = make_backend(tiny_spec)
    prompt_ids = encode(backend, PROMPTS[:2])
    completions = torch.tensor([[40, 41, 42], [43, 44, 45]])
    mask = torch.ones_like(completions, dtype=torch.bool)
    pad = tokenizer_of(tiny_spec.name_or_path).pad_token_id
    with torch.no_grad():
        tight = completion_logprobs(
            backend.model, *left_pad(prompt_ids, pad, backend.device), torch.arange(2), completions, mask, 1.0
        )
        padded = completion_logprobs(
            backend.model,
            *left_pad([*prompt_ids, [1] * 60], pad, backend.device),
            torch.arange(2),
            completions,
            mask,
            1.0,
        )
    torch.testing.assert_close(tight, padded, atol=1e-5, rtol=1e-5)


def test_rows_of_a_cpu_tensor_are_advanced_indexing_with_a_serial_backward():
    """The shared-prompt forward repeats each prompt's KV cache for its rows. On CPU the backward of that
    selection sums serially: the same gradient bit for bit as advanced indexing's in deterministic mode (which
    CPU runs use), and one gradient however often it runs without that mode (advanced indexing adds with
    atomics across threads there: hundreds of distinct gradients in 300 runs at this size, 2 threads)."""
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randn((8, 2, 30, 32), generator=generator)  # the quickstart's keys: ≥ 32768 elements repeated
    rows = torch.randint(0, 8, (64,), generator=generator)
    upstream = torch.randn((64, 2, 30, 32), generator=generator)

    def gradient(select) -> torch.Tensor:
        leaf = prompts.clone().requires_grad_()
        select(leaf).backward(upstream)
        return leaf.grad

    assert torch.equal(rows_of(prompts, rows), prompts[rows])
    with reproducible_torch(False, "cpu"):
        indexed = gradient(lambda t: t[rows])
        assert torch.equal(gradient(lambda t: rows_of(t, rows)), indexed)
    assert all(torch.equal(gradient(lambda t: rows_of(t, rows)), indexed) for _ in range(20))


def test_select_rows_selects_what_transformers_selects(tiny_spec):
    backend = make_backend(tiny_spec)
    prompts = torch.randint(3, 200, (3, 5), generator=torch.Generator().manual_seed(0))
    rows = torch.tensor([2, 0, 0, 1, 2])
    caches = []
    for select in (select_rows, DynamicCache.batch_select_indices):
        cache = DynamicCache(config=backend.model.config)
        with torch.no_grad():
            backend.model(input_ids=prompts, **with_cache(backend.model, cache), use_cache=True)
        select(cache, rows)
        caches.append(cache)
    for ours, theirs in zip(caches[0].layers, caches[1].layers, strict=True):
        assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)
