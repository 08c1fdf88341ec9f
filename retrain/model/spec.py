"""Which causal LM to train, where it runs, how its LoRA adapter is built, and how prompts reach it.

`ModelSpec` is at once the schema of the `model` config group (conf/model/*.yaml start from it as
`base_model`) and the object they instantiate, so each default is written here only. `name_or_path`
is a Hugging Face Hub id, a local directory, or `retrain:<name>`, a model bundled in
`retrain/assets/<name>/` (the offline tiny model is `retrain:tiny_qwen3`), so configs never hold
machine-specific paths. The config schemas import this module: torch and transformers are imported
where they are used, so composing a config stays quick.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from retrain.errors import ConfigError, UserError
from retrain.hub import hub_fetch, local_path
from retrain.plugins import built_in

if TYPE_CHECKING:
    import torch

ASSET_PREFIX = "retrain:"
# the attention and MLP projections of Qwen/Llama-style decoders
DEFAULT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# a local model directory holds at least one of these (fast, config, sentencepiece, BPE, WordPiece)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")
MAX_LISTED = 8  # entries of a directory named in an error
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}  # model.dtype -> torch dtype name


@built_in
@dataclass(kw_only=True)
class ModelSpec:
    """The base model and its LoRA adapter: the schema of `model.*` and the value it instantiates."""

    _target_: str = "retrain.model.spec.ModelSpec"
    name_or_path: str = "Qwen/Qwen3-4B-Instruct-2507"  # Hub id, local dir, or retrain:<bundled asset>
    revision: str | None = None
    lora_rank: int = 32
    lora_alpha: int = 0  # 0 = auto (2 * lora_rank)
    lora_dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: list(DEFAULT_TARGET_MODULES))
    dtype: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | bf16 | fp16 | fp32

    def __post_init__(self) -> None:
        if not self.name_or_path:
            raise ConfigError("model.name_or_path is empty: give a Hub id, a local directory or retrain:<asset>")
        if self.lora_rank <= 0:
            raise ConfigError(f"model.lora_rank must be > 0, got {self.lora_rank}")
        if self.lora_alpha < 0:
            raise ConfigError(f"model.lora_alpha must be >= 0 (0 = auto 2·rank), got {self.lora_alpha}")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ConfigError(f"model.lora_dropout must be in [0, 1), got {self.lora_dropout}")
        if not self.target_modules:
            raise ConfigError("model.target_modules is empty: LoRA needs at least one module to adapt")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ConfigError(f"model.dtype={self.dtype!r} is not one of auto, {', '.join(DTYPES)}")
        self.target_modules = list(self.target_modules)

    @property
    def effective_alpha(self) -> int:
        return self.lora_alpha or 2 * self.lora_rank

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        """bf16 on GPU and fp32 on CPU unless a dtype is forced."""
        import torch

        if self.dtype != "auto":
            return getattr(torch, DTYPES[self.dtype])
        return torch.bfloat16 if device.type == "cuda" else torch.float32

    def source(self) -> tuple[str, bool]:
        """(directory or Hub id to load from, whether it is a Hub id)."""
        if self.name_or_path.startswith(ASSET_PREFIX):
            return str(bundled_asset_dir(self.name_or_path[len(ASSET_PREFIX) :])), False
        local = local_path(self.name_or_path, "model.name_or_path")
        if local is None:
            return self.name_or_path, True
        if not local.is_dir():
            raise ConfigError(f"model.name_or_path={self.name_or_path!r} is a file; give the model's directory")
        if not (local / "config.json").is_file():
            held = sorted(entry.name for entry in local.iterdir())
            raise ConfigError(
                f"model.name_or_path={self.name_or_path!r} holds no config.json, so it is not a model's directory "
                f"(it holds: {', '.join(held[:MAX_LISTED]) or 'nothing'}{', ...' if len(held) > MAX_LISTED else ''})"
            )
        return str(local), False

    def load_tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        path, from_hub = self.source()
        if not from_hub and not any((Path(path) / name).is_file() for name in TOKENIZER_FILES):
            # transformers would build an empty tokenizer from config.json alone
            raise ConfigError(
                f"model.name_or_path={self.name_or_path!r} holds no tokenizer file (none of {', '.join(TOKENIZER_FILES)})"
            )
        with self._loading(from_hub, "tokenizer"):
            tokenizer = AutoTokenizer.from_pretrained(path, revision=self.revision)
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        return tokenizer

    def load_lora_model(self, device: torch.device, seed: int) -> Any:
        """The base model on `device` in its dtype, wrapped in a fresh LoRA adapter whose
        initialisation depends only on `seed` (the global RNG is left untouched)."""
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        from retrain.model.attention import use_fast_sdpa
        from retrain.model.output_logits import use_fp32_logits

        path, from_hub = self.source()
        with self._loading(from_hub, "weights"):
            base = AutoModelForCausalLM.from_pretrained(path, revision=self.revision, dtype=self.torch_dtype(device))
        base.to(device)  # type: ignore[arg-type]  # transformers' annotation of `to` is wrong
        use_fast_sdpa(base)
        lora = LoraConfig(
            r=self.lora_rank,
            lora_alpha=self.effective_alpha,
            lora_dropout=self.lora_dropout,
            target_modules=self.target_modules,
            bias="none",
            task_type="CAUSAL_LM",
        )
        cuda_devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda_devices):
            torch.manual_seed(seed)
            try:
                with warnings.catch_warnings():  # PEFT calls a transformers API deprecated in v5
                    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
                    model = get_peft_model(base, lora)
            except ValueError as error:
                raise ConfigError(
                    f"model.target_modules={self.target_modules} do not fit {self.name_or_path}: {error}"
                ) from error
        use_fp32_logits(model)  # after PEFT: a head it adapts keeps its own dtype
        return model

    @contextmanager
    def _loading(self, from_hub: bool, what: str) -> Iterator[None]:
        """Hub downloads fail fast, naming the model and the offline demo, when the Hub is unreachable;
        a local directory transformers cannot read is named with transformers' first line of why."""
        if from_hub:
            with hub_fetch(self.name_or_path, "model", "model.name_or_path"):
                yield
            return
        from safetensors import SafetensorError

        try:
            yield
        except (OSError, ValueError, SafetensorError) as error:
            if isinstance(error, UserError):
                raise
            why = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise ConfigError(f"model.name_or_path={self.name_or_path!r}: cannot load its {what}: {why}") from error


class ChatPrompts:
    """User messages -> chat-templated prompt ids (generation prompt added); each distinct prompt is
    encoded once per run."""

    def __init__(self, tokenizer: Any, model_name: str) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError(f"model.name_or_path={model_name!r}: its tokenizer has no chat template")
        self.tokenizer = tokenizer
        self._encoded: dict[str, list[int]] = {}

    def __call__(self, prompts: list[str]) -> list[list[int]]:
        missing = list(dict.fromkeys(prompt for prompt in prompts if prompt not in self._encoded))
        if missing:
            conversations = [[{"role": "user", "content": prompt}] for prompt in missing]
            encoded = self.tokenizer.apply_chat_template(
                conversations, add_generation_prompt=True, tokenize=True, return_dict=True
            )
            self._encoded.update(zip(missing, (list(ids) for ids in encoded["input_ids"])))
        return [self._encoded[prompt] for prompt in prompts]


def bundled_asset_dir(name: str) -> Path:
    """Directory of a model shipped in retrain/assets/ (the `retrain:<name>` form of name_or_path)."""
    directory = Path(str(resources.files("retrain.assets").joinpath(name)))
    if not directory.is_dir():
        raise ConfigError(
            f"model.name_or_path={ASSET_PREFIX}{name}: no bundled model at {directory} "
            "(is the retrain package installed completely?)"
        )
    return directory
