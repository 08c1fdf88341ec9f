"""The bundled tiny model loads offline, its tokenizer is exact, and it knows some arithmetic."""

from __future__ import annotations

import json
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast, Qwen3ForCausalLM

from retrain.assets import TINY_MODEL_DIR
from retrain.data.arithmetic import ArithmeticData, ArithmeticDataConfig

CHAT_PROMPT = "<|im_start|>user\nWhat is 47+38?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return AutoTokenizer.from_pretrained(TINY_MODEL_DIR, local_files_only=True)


@pytest.fixture(scope="module")
def model() -> Qwen3ForCausalLM:
    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR, local_files_only=True).eval()


def test_ships_a_small_qwen3(model: Qwen3ForCausalLM) -> None:
    assert type(model) is Qwen3ForCausalLM and model.config.model_type == "qwen3"
    assert 0.5e6 < sum(p.numel() for p in model.parameters()) < 1.5e6
    assert sum(f.stat().st_size for f in TINY_MODEL_DIR.iterdir()) < 5e6


def test_special_tokens_agree_across_files(tokenizer: PreTrainedTokenizerFast, model: Qwen3ForCausalLM) -> None:
    assert isinstance(tokenizer, PreTrainedTokenizerFast) and tokenizer.is_fast
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|im_end|>", "<|endoftext|>")
    expected = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    for name in ("config.json", "generation_config.json"):
        saved = json.loads((TINY_MODEL_DIR / name).read_text())
        assert {key: saved[key] for key in expected} == expected, name
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") != tokenizer.unk_token_id


def test_boxed_answer_costs_five_tokens(tokenizer: PreTrainedTokenizerFast) -> None:
    assert len(tokenizer.encode("\\boxed{", add_special_tokens=False)) == 1
    assert len(tokenizer.encode("\\boxed{85}<|im_end|>", add_special_tokens=False)) == 5
    assert "\\boxed{" not in tokenizer.all_special_tokens  # survives skip_special_tokens


@settings(max_examples=100, deadline=None)
@given(text=st.text(max_size=80))
def test_decode_gives_back_any_text(tokenizer: PreTrainedTokenizerFast, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_offsets_map_each_token_to_its_characters(tokenizer: PreTrainedTokenizerFast) -> None:
    text = "What is 47+38? \\boxed{85}"
    encoding = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)
    pieces = [text[start:end] for start, end in encoding["offset_mapping"]]
    assert pieces == [*list("What is 47+38? "), "\\boxed{", "8", "5", "}"]


def test_chat_template_builds_the_generation_prompt(tokenizer: PreTrainedTokenizerFast) -> None:
    messages = [{"role": "user", "content": "What is 47+38?"}]
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == CHAT_PROMPT
    # transformers 5 returns a BatchEncoding when tokenizing; return_dict=False gives the bare ids.
    encoding = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert encoding["input_ids"] == ids and len(ids) == 33
    assert tokenizer.decode(ids) == CHAT_PROMPT


def test_greedy_answers_on_held_out_problems_are_often_right(
    tokenizer: PreTrainedTokenizerFast, model: Qwen3ForCausalLM
) -> None:
    held_out = ArithmeticData(ArithmeticDataConfig(), seed=0).held_out(64)
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": ex.prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for ex in held_out
    ]
    assert len({len(p) for p in prompts}) == 1  # 2-digit problems: no padding needed
    with torch.no_grad():
        output = model.generate(torch.tensor(prompts), max_new_tokens=8, do_sample=False)
    completions = tokenizer.batch_decode(output[:, len(prompts[0]) :], skip_special_tokens=True)
    assert all(re.fullmatch(r"\\boxed\{\d+\}", text) for text in completions), completions
    correct = sum(text == f"\\boxed{{{ex.reference}}}" for text, ex in zip(completions, held_out))
    assert 0 < correct < len(held_out)  # learned something, left room for RL
