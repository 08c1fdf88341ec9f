"""The parts of benchmarks/real_scale.py that compute rather than time: its bounds and its offline model files."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

from benchmarks._real_scale_model import EOS, SPECIAL_TOKENS, qwen3_4b_config, special_ids, write_tokenizer
from benchmarks._speed_bounds import causal_attention_flops, causal_training_flops, decode_kv_reads, matmul_parameters
from retrain.inference.sampler.kv_pool import KvShape
from retrain.model.memory_plan import ModelShape
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


def test_the_plan_and_the_engine_agree_on_qwen3_4b_kv_bytes_per_token() -> None:
    """The plan reads config.json before loading, the engine's pool the loaded config: both give 144 KiB in bf16."""
    model = qwen3_4b()
    planned = ModelShape.from_config(qwen3_4b_config()).kv_bytes_per_token(2)
    assert planned == KvShape.of(model.config, torch.bfloat16).bytes_per_token == 36 * 8 * 128 * 2 * 2


def test_a_vocabulary_smaller_than_qwens_takes_the_chat_tokens_at_its_last_ids(tmp_path: Path) -> None:
    write_tokenizer(tmp_path, 300)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tokenizer) == 300 and special_ids(300) == dict(zip(SPECIAL_TOKENS, (297, 298, 299), strict=True))
    assert tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == [297, 298, 299]


def test_causal_training_flops_count_every_token_and_each_querys_causal_keys_once() -> None:
    """A group's prompt is attended once; each completion sees the prompt and its own earlier tokens."""
    config = Qwen3Config(
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=4,
        vocab_size=10,
    )
    prompts, groups = [2, 3], [[1, 2], [4]]
    pairs = sum(
        sum(range(1, prompt + 1)) + sum(prompt + j + 1 for c in group for j in range(c))
        for prompt, group in zip(prompts, groups, strict=True)
    )
    tokens, completions = 2 + 1 + 2 + 3 + 4, 1 + 2 + 4
    head = 10 * 8
    body = matmul_parameters(config) - head
    attention = pairs * 7 * 2 * 4 * 2 * 2  # 7 matmuls of 2 · head_dim FLOPs, 2 heads, 2 layers
    assert causal_attention_flops(config, prompts, groups) == attention
    expected = (4 * body + 6 * 5) * tokens + 4 * head * completions + attention
    assert causal_training_flops(config, 5, prompts, groups) == expected
