"""A model's config.json read without a download, and what can be counted from it before any weight loads.

`retrain explain`'s time estimate (retrain/commands/capacity.py) and the memory plan (retrain/model/memory_plan.py)
both size a model from here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from retrain.assets import MODEL_CONFIGS_DIR
from retrain.errors import ConfigError

# the sizes the plan and the parameter count divide and multiply by; absent ones the plan reports as lacking
SIZE_FIELDS = (
    "hidden_size",
    "num_hidden_layers",
    "intermediate_size",
    "vocab_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
)


def params_from_config(config: Mapping[str, Any]) -> float | None:
    """A dense decoder's parameter count from its Hugging Face config (embeddings, attention, gated MLP)."""
    config = config.get("text_config", config)  # multimodal wrappers keep the language model's here
    try:
        hidden, layers = int(config["hidden_size"]), int(config["num_hidden_layers"])
        intermediate, vocab = int(config["intermediate_size"]), int(config["vocab_size"])
        heads = int(config["num_attention_heads"])
    except (KeyError, TypeError, ValueError):
        return None
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
    per_layer = attention + 3 * hidden * intermediate + 2 * hidden  # q/o, k/v, gate/up/down, two norms
    embeddings = vocab * hidden * (1 if config.get("tie_word_embeddings", False) else 2)
    return float(embeddings + layers * per_layer + hidden)


def local_model_config(name_or_path: str, revision: str | None) -> dict[str, Any] | None:
    from retrain.model.spec import ASSET_PREFIX, bundled_asset_dir

    path: Path | None
    if name_or_path.startswith(ASSET_PREFIX):
        path = bundled_asset_dir(name_or_path[len(ASSET_PREFIX) :]) / "config.json"
    elif Path(name_or_path).expanduser().is_dir():
        path = Path(name_or_path).expanduser() / "config.json"
    else:
        from huggingface_hub import try_to_load_from_cache

        try:
            cached = try_to_load_from_cache(name_or_path, "config.json", revision=revision)
        except ValueError:  # not a valid repo id
            return None
        path = Path(cached) if isinstance(cached, str) else None
    if path is None or not path.is_file():
        return None
    return read_config_file(path)


def read_config_file(path: Path) -> dict[str, Any]:
    """A model's config.json, its sizes checked: ConfigError naming the file when it cannot be read or is not valid
    JSON (a download or copy cut short), and the field when a size is not a positive integer (a 0 would divide by
    zero in the plan, a negative count plan negative memory that "fits")."""
    where = f"the config.json of model.name_or_path, {path}"
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"{where}: cannot be read ({error})") from error
    try:
        loaded = json.loads(text)
    except json.JSONDecodeError as error:
        raise ConfigError(f"{where}: is not valid JSON ({error}); a download or copy cut short?") from error
    if not isinstance(loaded, dict):
        raise ConfigError(f"{where}: holds a JSON {type(loaded).__name__}, not an object of settings")
    nested = isinstance(loaded.get("text_config"), dict)  # a multimodal wrapper: the language model's sizes
    sizes = loaded["text_config"] if nested else loaded
    for name in SIZE_FIELDS:
        value = sizes.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise ConfigError(f"{where}: {'text_config.' if nested else ''}{name}={value!r} is not a positive integer")
    return loaded


def model_config(name_or_path: str, revision: str | None = None) -> dict[str, Any] | None:
    """The model's config.json without a download: a local copy (a directory, a bundled asset, the Hugging Face
    cache), else the one retrain ships for a known Hub model (retrain/assets/model_configs/<last part of the id>)."""
    found = local_model_config(name_or_path, revision)
    if found is not None:
        return found
    shipped = MODEL_CONFIGS_DIR / f"{name_or_path.rstrip('/').rsplit('/', 1)[-1]}.json"
    return read_config_file(shipped) if shipped.is_file() else None
