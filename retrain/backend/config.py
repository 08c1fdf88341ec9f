"""Schemas of the `backend` config group (conf/backend/*.yaml)."""

from __future__ import annotations

from dataclasses import dataclass, field

from retrain.backend.option_rules import at_least, one_of
from retrain.backend.prime_rl.config import PrimeRlBackendConfig
from retrain.backend.tinker.config import TinkerBackendConfig

AUTO_SWITCH_CHOICES = ("auto", "true", "false")
TRAIN_ATTENTION_MODES = ("auto", "mask", "flex")  # backend.train_attention


def auto_switch(value: object) -> str:
    """An auto | true | false setting (`backend.gradient_checkpointing`, `backend.fused_elementwise`) as one of
    those (a YAML or command-line boolean arrives as the string "True"/"False"); ValueError saying what is valid
    otherwise."""
    choice = str(value).strip().lower()
    if choice not in AUTO_SWITCH_CHOICES:
        raise ValueError(f"must be one of {', '.join(AUTO_SWITCH_CHOICES)}")
    return choice


@dataclass
class LocalBackendConfig:
    """PyTorch/PEFT training on this machine; the model, optimiser and loss settings and the seed come
    from the composition root at instantiate time."""

    _target_: str = "retrain.backend.local.LocalBackend"
    devices: str = field(
        default="gpu:0",
        metadata={
            "help": '"cpu" or "gpu:N" (CPU with a warning when CUDA is absent); split mode "gpu:I,gpu:T" samples '
            "on the first while training on the last"
        },
    )
    # 8192: by an estimate of what autograd keeps (~76k bf16 values a token and layer), Qwen3-4B's LoRA forward
    # holds ~5.5 MB of activations a token, ~45 GB at 8192 tokens: with its 8 GB of weights it fits an 80 GB GPU
    # beside the sampler's KV cache. A small model's step stays one forward (the quickstart's ~2,300 padded tokens),
    # where the cost of each op, not its arithmetic, dominates. A 10,240-token row runs alone.
    micro_batch_tokens: int = field(
        default=8192,
        metadata={
            "help": "padded tokens (prompt + completion) per forward/backward: rows are packed by length up to it, a "
            "longer row alone; bounds activation memory, never changes the gradient. 0 = all rows at once",
            "validator": at_least(0, "0 = all rows"),
        },
    )
    gradient_checkpointing: str = field(
        default="auto",
        metadata={
            "help": "recompute activations in backward (less memory, ~30% slower): true | false | auto (on when the "
            "memory plan says activations would not fit otherwise)",
            "validator": auto_switch,
        },
    )

    train_attention: str = field(
        default="auto",
        metadata={
            "help": "the training forward's attention: flex (every row's real tokens back to back, flex_attention "
            "over a document BlockMask: no padding, no masked scores; a GPU with triton) | mask (groups packed "
            "with a dense mask, or a shared prompt prefill) | auto (flex where it can run, else mask)",
            "validator": one_of(TRAIN_ATTENTION_MODES),
        },
    )
    fused_elementwise: str = field(
        default="auto",
        metadata={
            "help": "the training forward's rotary embedding and SiLU·up as one compiled kernel each way "
            "(torch.compile; each intermediate rounded as eager rounds it): true | false | auto (on a GPU with "
            "triton). Fewer bytes moved per layer, one activation less kept for backward",
            "validator": auto_switch,
        },
    )


SCHEMAS: dict[str, type] = {
    "base_local": LocalBackendConfig,
    "base_tinker": TinkerBackendConfig,
    "base_prime_rl": PrimeRlBackendConfig,
}
