"""The parts of benchmarks/real_scale.py that compute rather than time: its bounds and its offline model files."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

from benchmarks._real_scale_model import EOS, SPECIAL_TOKENS, qwen3_4b_config, write_tokenizer
from benchmarks._speed_bounds import decode_kv_reads, matmul_parameters
from retrain.model.spec import ChatPrompts


def qwen3_4b(layers: int | None = None) -> Qwen3ForCausalLM:
    """The shipped Qwen3-4B config as a model on the meta device (shapes only, no memory)."""
    values = qwen3_4b_config(layers)
    config = Qwen3Config(**{key: value for key, value in values.items() if key not in ("architectures", "torch_dtype")})
    with torch.device("meta"):
        return Qwen3ForCausalLM(config)


def test_matmul_parameters_are_the_weights_of_the_models_linear_layers() -> None:
    """PRIME-RL's count from the config equals the model's own linear layers (projections, MLP, the tied LM head)."""
    model = qwen3_4b()
    linear = sum(module.weight.numel() for module in model.modules() if isinstance(module, torch.nn.Linear))
    assert matmul_parameters(model.config) == linear


def test_cutting_the_depth_keeps_the_width_and_the_vocabulary() -> None:
    full, cut = qwen3_4b_config(), qwen3_4b_config(2)
    assert cut["num_hidden_layers"] == 2 and full["num_hidden_layers"] == 36
    assert {key: value for key, value in cut.items() if "layers" not in key} == {
        key: value for key, value in full.items() if "layers" not in key
    }


def test_decode_kv_reads_count_what_each_decode_forward_attends_to() -> None:
    """Row by row and step by step: the t-th decode forward of a row attends to its prompt and t generated tokens."""
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(1, 50, (12,), generator=generator)
    completions = torch.randint(0, 40, (12,), generator=generator)
    stepped = sum(int(p) + t for p, c in zip(prompts, completions) for t in range(1, int(c)))
    assert decode_kv_reads(prompts, completions) == stepped


def test_offline_tokenizer_has_the_vocabulary_size_and_qwens_chat_tokens(tmp_path: Path) -> None:
    vocab_size = qwen3_4b_config()["vocab_size"]
    write_tokenizer(tmp_path, vocab_size)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tokenizer) == vocab_size
    assert tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == list(SPECIAL_TOKENS.values())
    assert tokenizer.eos_token == EOS
    prompt = ChatPrompts(tokenizer, str(tmp_path))(["add 2 and 3"])[0]
    assert tokenizer.decode(prompt) == "<|im_start|>user\nadd 2 and 3<|im_end|>\n<|im_start|>assistant\n"
    words = tokenizer.decode(list(range(vocab_size - 3, vocab_size)))  # the last entries: lowercase words
    assert words.replace(" ", "").isalpha() and words.startswith(" ")
