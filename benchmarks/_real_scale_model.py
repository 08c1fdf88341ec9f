"""A local model directory shaped exactly as Qwen3-4B-Instruct-2507, random weights, built offline.

The config is the shipped one (retrain/assets/model_configs/), only `num_hidden_layers` may be cut so a
CPU can run it; the tokenizer has Qwen's vocabulary size and special tokens, so the LM head, the
sampler's [rows, vocabulary] work and the log-probs cost what they cost on the real model. retrain's
own ModelSpec and LocalBackend load the directory like any downloaded model.

The tokenizer is byte-level BPE without merges: any text encodes (one token per byte), and the entries
past the 256 bytes are short lowercase words, so a random model's completions decode to words.
"""

from __future__ import annotations

import itertools
import json
import math
import string
from importlib import resources
from pathlib import Path
from typing import Any

CONFIG = "model_configs/Qwen3-4B-Instruct-2507.json"
# Qwen's special tokens and their ids; regular entries fill every id below and above them
SPECIAL_TOKENS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645}
PAD, EOS = "<|endoftext|>", "<|im_end|>"
# Qwen's template without tools or thinking: what ChatPrompts needs to encode a user message
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def qwen3_4b_config(layers: int | None = None) -> dict[str, Any]:
    """The shipped config.json of Qwen3-4B-Instruct-2507, with `layers` decoder layers when given."""
    config = json.loads(resources.files("retrain.assets").joinpath(CONFIG).read_text())
    if layers is not None:
        if not 1 <= layers <= config["num_hidden_layers"]:
            raise ValueError(f"layers must be in [1, {config['num_hidden_layers']}], got {layers}")
        config["num_hidden_layers"] = config["max_window_layers"] = layers
    return config


def write_model(directory: Path, layers: int | None, device: str, seed: int = 0) -> dict[str, Any]:
    """config.json + safetensors (bf16, random weights drawn on `device` from `seed`) + tokenizer; returns
    the config written."""
    values = qwen3_4b_config(layers)
    write_random_model(directory, values, device, seed)
    return values


def write_random_model(directory: Path, values: dict[str, Any], device: str, seed: int = 0) -> None:
    """The model of config.json `values` (any transformers causal LM) with random bf16 weights drawn on `device`
    from `seed`, and a tokenizer of its vocabulary size, in `directory`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    settings = {key: value for key, value in values.items() if key not in ("architectures", "torch_dtype", "dtype")}
    config = AutoConfig.for_model(**settings)
    with torch.device("meta"):  # no memory, no initialisation: the weights are drawn below, once
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.to_empty(device=device)
    model.tie_weights()  # to_empty gave the LM head its own storage
    draw_weights(model, config.initializer_range, torch.Generator(device=device).manual_seed(seed))
    model.save_pretrained(directory)
    del model
    write_tokenizer(directory, values["vocab_size"])


def draw_weights(model: Any, std: float, generator: Any) -> None:
    """RMSNorm weights (Qwen3's only 1-D parameters) 1, every matrix uniform with standard deviation `std`:
    the scale of transformers' normal init, drawn faster (where the model lives: on CUDA, in seconds)."""
    import torch

    bound = std * math.sqrt(3.0)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 1:
                parameter.fill_(1.0)
            else:  # drawn in fp32, which torch draws faster than bf16 on a CPU
                drawn = torch.empty(parameter.shape, device=parameter.device, dtype=torch.float32)
                parameter.copy_(drawn.uniform_(-bound, bound, generator=generator))


def write_tokenizer(directory: Path, vocab_size: int) -> Any:
    """A fast tokenizer of exactly `vocab_size` entries with Qwen's special tokens (`special_ids`), saved in `directory`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    regular = itertools.chain(sorted(alphabet), filler_words(byte_level))
    specials = special_ids(vocab_size)
    vocab: dict[str, int] = {}
    for index in range(vocab_size):
        special = next((token for token, at in specials.items() if at == index), None)
        vocab[special if special is not None else next(regular)] = index
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[token for token in SPECIAL_TOKENS if token not in (EOS, PAD)],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)
    return fast


def special_ids(vocab_size: int) -> dict[str, int]:
    """Qwen's special tokens at Qwen's ids, or at the vocabulary's last ids where it is smaller than Qwen's."""
    if vocab_size > max(SPECIAL_TOKENS.values()):
        return SPECIAL_TOKENS
    return {token: vocab_size - len(SPECIAL_TOKENS) + at for at, token in enumerate(SPECIAL_TOKENS)}


def filler_words(byte_level: Any) -> Any:
    """' ab', ' ac', ... then three- and four-letter words, in the byte-level alphabet (a leading space is 'Ġ')."""
    space = byte_level.pre_tokenize_str(" a")[0][0][0]
    for length in itertools.count(2):
        for letters in itertools.product(string.ascii_lowercase, repeat=length):
            yield space + "".join(letters)
