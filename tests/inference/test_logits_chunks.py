"""The trainer's LM head over chunks of tokens gives transformers' full-logits log-probs and gradients on every
forward path, and models whose logits are more than their head's output keep the full logits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM, Gemma2Config, Qwen3Config

import retrain.model.logprobs as logprobs_module
import retrain.model.packing as packing_module
from retrain.model.lean_decoder import LeanForward, causal_lm_hidden
from retrain.model.logprobs import completion_logprobs, left_pad, output_head, scaled_log_softmax
from retrain.model.rows import positions_from_mask
from tests.backend.tiny_model import PROMPTS, encode, make_backend, tokenizer_of

TEMPERATURE = 0.8
TOKENS_PER_CHUNK = 3  # forced, so that the tiny model's 19 completion tokens take 7 chunks


def tiny_rows(backend, spec) -> tuple[torch.Tensor, ...]:
    """Three left-padded prompts, five right-padded completions of 1-6 tokens (19 in all), rows in no group order."""
    prompts, prompt_mask = left_pad(encode(backend, PROMPTS[:3]), tokenizer_of(spec.name_or_path).pad_token_id, "cpu")
    lengths = torch.tensor([3, 6, 1, 5, 4])
    completions = torch.randint(3, 250, (5, 6), generator=torch.Generator().manual_seed(2))
    return prompts, prompt_mask, torch.tensor([1, 0, 2, 1, 0]), completions, torch.arange(6) < lengths.unsqueeze(1)


def full_logits_reference(model, rows: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """[R, T] log-probs from transformers' own forward and full logits, one forward per row: the unchunked way."""
    prompts, prompt_mask, index, completions, completion_mask = rows
    input_ids = torch.cat([prompts[index], completions], dim=1)
    mask = torch.cat([prompt_mask[index], completion_mask], dim=1)
    width = completions.shape[1]
    output = model(
        input_ids=input_ids,
        attention_mask=mask.long(),
        position_ids=positions_from_mask(mask),
        logits_to_keep=width + 1,
    )
    logprobs = scaled_log_softmax(output.logits[:, :-1], TEMPERATURE)
    return logprobs.gather(-1, completions.unsqueeze(-1)).squeeze(-1).masked_fill(~completion_mask, 0.0)


def logprobs_and_gradient(model, rows, compute) -> tuple[torch.Tensor, torch.Tensor]:
    """The log-probs `compute` gives and the gradient of a weighted sum of them w.r.t. the adapter."""
    model.zero_grad()
    logprobs = compute()
    weights = torch.linspace(0.5, 1.5, logprobs.numel()).view_as(logprobs)
    (logprobs * weights).sum().backward()
    gradient = torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad])
    return logprobs.detach(), gradient


def with_nonzero_adapter(model):
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.05, generator=torch.Generator().manual_seed(len(name)))
    return model


def assert_same(chunked, reference) -> None:
    """Equal to fp32 rounding: the ways differ in summation order only."""
    torch.testing.assert_close(chunked[0], reference[0], atol=2e-5, rtol=1e-5)
    assert (chunked[1] - reference[1]).norm() <= 1e-5 * reference[1].norm()


@pytest.mark.parametrize(
    ("path", "share_prompts", "score_ratio", "activation_checkpointing"),
    [
        ("packed", True, 1_000, False),
        ("shared prompt cache", True, 0, False),
        ("one forward per row", False, 0, False),
        ("packed under activation checkpointing", True, 1_000, True),
        ("one forward per row under activation checkpointing, which keeps no prompt cache", True, 0, True),
    ],
)
def test_chunked_head_gives_the_full_logits_logprobs_and_gradient(
    tiny_spec, monkeypatch, path, share_prompts, score_ratio, activation_checkpointing
):
    backend = make_backend(tiny_spec, gradient_checkpointing=activation_checkpointing)
    model = with_nonzero_adapter(backend.model).train()
    rows = tiny_rows(backend, tiny_spec)
    monkeypatch.setattr(packing_module, "PACKED_SCORE_RATIO", score_ratio)
    vocabulary = output_head(model).weight.shape[0]
    monkeypatch.setattr(logprobs_module, "LOGITS_CHUNK_BYTES", TOKENS_PER_CHUNK * 4 * vocabulary)
    head_calls: list[int] = []
    hook = output_head(model).register_forward_hook(lambda module, args, out: head_calls.append(len(args[0])))

    def chunked() -> torch.Tensor:
        logprobs = completion_logprobs(model, *rows, TEMPERATURE, share_prompts=share_prompts)
        assert head_calls == [3, 3, 3, 3, 3, 3, 1]  # 19 real completion tokens, never a padded one
        return logprobs

    result = logprobs_and_gradient(model, rows, chunked)
    hook.remove()
    reference = logprobs_and_gradient(model, rows, lambda: full_logits_reference(model, rows))
    assert_same(result, reference)
    assert (result[0][~rows[4]] == 0).all()


def test_one_chunk_and_many_chunks_agree_in_the_kl_base_forward(tiny_spec, monkeypatch):
    """Without grad (the KL's base log-probs, adapter disabled) the chunks run plainly, one after the other."""
    backend = make_backend(tiny_spec)
    model = with_nonzero_adapter(backend.model)
    rows = tiny_rows(backend, tiny_spec)
    results = []
    for chunk_bytes in (logprobs_module.LOGITS_CHUNK_BYTES, 4 * output_head(model).weight.shape[0]):
        monkeypatch.setattr(logprobs_module, "LOGITS_CHUNK_BYTES", chunk_bytes)
        with torch.no_grad(), model.disable_adapter():
            results.append(completion_logprobs(model, *rows, TEMPERATURE))
    with torch.no_grad(), model.disable_adapter():
        reference = full_logits_reference(model, rows)
    torch.testing.assert_close(results[0], results[1], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(results[1], reference, atol=2e-5, rtol=1e-5)


def random_lora_model(config, attention: str = "sdpa"):
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config, attn_implementation=attention)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0)
    return with_nonzero_adapter(get_peft_model(base, lora)).train()


SIZES = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 300,
    "max_position_embeddings": 64,
}


def random_rows(prompt_lengths: list[int], completion_lengths: list[int], index: list[int]) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 300, (n,), generator=generator).tolist() for n in prompt_lengths]
    prompt_ids, prompt_mask = left_pad(prompts, 0, torch.device("cpu"))
    width = max(completion_lengths)
    completions = torch.randint(3, 300, (len(completion_lengths), width), generator=generator)
    completion_mask = torch.arange(width) < torch.tensor(completion_lengths).unsqueeze(1)
    return prompt_ids, prompt_mask, torch.tensor(index), completions, completion_mask


def test_transformers_decoder_forward_with_a_shared_prompt_cache_takes_the_chunked_head(monkeypatch):
    """Eager attention is not the lean forward's: the hidden states come from transformers' decoder, cache and all."""
    model = random_lora_model(Qwen3Config(**SIZES), attention="eager")
    assert LeanForward.of(model) is None
    rows = random_rows([4, 7], [5, 2, 6], [1, 0, 1])
    monkeypatch.setattr(logprobs_module, "LOGITS_CHUNK_BYTES", 2 * 4 * SIZES["vocab_size"])
    chunked = logprobs_and_gradient(model, rows, lambda: completion_logprobs(model, *rows, TEMPERATURE))
    assert_same(chunked, logprobs_and_gradient(model, rows, lambda: full_logits_reference(model, rows)))


def test_a_final_logit_softcap_keeps_the_full_logits(monkeypatch):
    """Gemma 2 soft-caps its logits after the head: the head alone would give other log-probs, so its full logits
    (softcap included) are used."""
    config = Gemma2Config(**SIZES, final_logit_softcapping=5.0, sliding_window=16)
    model = random_lora_model(config, attention="eager")
    assert output_head(model) is None
    ids = torch.randint(3, 300, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        capped = model(input_ids=ids).logits
        assert not torch.allclose(model.get_output_embeddings()(causal_lm_hidden(model, ids)), capped, atol=1e-3)
    rows = random_rows([4, 7], [5, 2, 6], [1, 0, 1])
    monkeypatch.setattr(logprobs_module, "LOGITS_CHUNK_BYTES", 2 * 4 * SIZES["vocab_size"])
    for share_prompts in (True, False):
        logprobs = logprobs_and_gradient(
            model, rows, lambda share=share_prompts: completion_logprobs(model, *rows, TEMPERATURE, share_prompts=share)
        )
        assert_same(logprobs, logprobs_and_gradient(model, rows, lambda: full_logits_reference(model, rows)))


# small experts for the MoE models, token ids inside the small vocabulary for all
OTHER_SIZES = {"num_experts": 4, "num_local_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
TOKEN_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


@pytest.mark.parametrize("model_type", sorted(logprobs_module.PLAIN_HEAD))
def test_a_plain_head_model_computes_its_logits_with_the_head_alone(model_type):
    """transformers' logits of each model type in PLAIN_HEAD are its output embeddings of the decoder's last hidden
    states, bit for bit, so the chunked head reproduces them."""
    config = AutoConfig.for_model(model_type, **SIZES, **OTHER_SIZES, **TOKEN_IDS)
    model = random_lora_model(config).eval()
    ids = torch.randint(3, 300, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        hidden = causal_lm_hidden(model, ids)
        assert torch.equal(output_head(model)(hidden), logits)


BIG_VOCABULARY = 151_936  # Qwen3's
MEMORY_TEST_TOKENS = 640  # completion tokens: their full fp32 logits would take 389 MB
MEMORY_TEST_CHUNK_BYTES = 8 * 2**20  # 13 tokens


def peak_memory_growth() -> None:
    """In a fresh process: forward and backward of `completion_logprobs` through a random Qwen3 with Qwen3's
    vocabulary and a tiny decoder; prints the peak resident memory it added (bytes) and the full logits' size."""
    logprobs_module.LOGITS_CHUNK_BYTES = MEMORY_TEST_CHUNK_BYTES
    config = Qwen3Config(
        **{**SIZES, "num_hidden_layers": 1, "vocab_size": BIG_VOCABULARY, "max_position_embeddings": 2048},
        tie_word_embeddings=True,
    )
    model = random_lora_model(config)
    generator = torch.Generator().manual_seed(0)

    def step(tokens: int) -> None:
        prompt = torch.randint(3, BIG_VOCABULARY, (1, 8), generator=generator)
        completion = torch.randint(3, BIG_VOCABULARY, (1, tokens), generator=generator)
        mask = torch.ones_like(completion, dtype=torch.bool)
        logprobs = completion_logprobs(
            model,
            prompt,
            torch.ones_like(prompt, dtype=torch.bool),
            torch.zeros(1, dtype=torch.long),
            completion,
            mask,
            TEMPERATURE,
        )
        logprobs.sum().backward()

    step(16)  # kernels and the allocator's first pages in place
    baseline = resident_bytes("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) starts again from here
    step(MEMORY_TEST_TOKENS)
    print(json.dumps({"growth": resident_bytes("VmHWM") - baseline, "full": MEMORY_TEST_TOKENS * BIG_VOCABULARY * 4}))


def resident_bytes(field: str) -> int:
    """A resident-memory figure of this process from /proc/self/status (kB there)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's resettable peak RSS")
def test_the_full_fp32_logits_are_never_built_in_forward_or_backward():
    """Over 640 tokens of a 151,936-entry vocabulary the full fp32 logits take 389 MB; the step's peak adds less
    than a quarter of that (a few 8 MiB chunks' worth), so no [tokens, vocabulary] tensor, in forward or backward,
    was ever built whole. glibc's malloc keeps freed blocks below its mmap threshold, which grows to the largest
    block freed, in the process (measured: 640 MB of 729 MB at 1,200 tokens, 82 MB with a fixed threshold);
    fixed at 64 KiB, every chunk's logits go back to the system when freed, and the resident peak is the live one."""
    root = Path(__file__).resolve().parents[2]
    environment = {
        **os.environ,
        "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "OMP_NUM_THREADS": "1",
        "MALLOC_MMAP_THRESHOLD_": "65536",
    }
    child = subprocess.run(
        [
            sys.executable,
            "-c",
            "from tests.inference.test_logits_chunks import peak_memory_growth; peak_memory_growth()",
        ],
        env=environment,
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
    )
    measured = json.loads(child.stdout.strip().splitlines()[-1])
    assert measured["growth"] < measured["full"] / 4
