"""Schemas of the `inference` config group (conf/inference/*.yaml).

The composition root (retrain.run.build_part) builds every engine as the partial `instantiate(cfg.inference)`
completed with `tokenizer=<the run's tokenizer>, resources=backend.engine_resources()`; a built-in converts its
keys through its schema here (retrain.settings_object). Each schema checks its
values when the config is checked (retrain/config_checks/validation.py), before data, a tokenizer or a model loads;
what depends on the device (an attention kernel on CPU) is checked when the engine starts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from retrain.errors import ConfigError

# inference.dtype / kv_cache_dtype / attention_kernel -> vLLM's names (None: vLLM's own choice)
VLLM_WEIGHT_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
VLLM_QUANTIZED_DTYPES = {"fp8": "fp8"}  # served with on-the-fly quantization of the base weights
VLLM_KV_CACHE_DTYPES = {"auto": "auto", "bf16": "bfloat16", "fp8": "fp8", "int8": "int8_per_token_head"}
VLLM_ATTENTION_BACKENDS = {"default": None, "flash": "FLASH_ATTN", "triton": "TRITON_ATTN", "cutlass": "CUTLASS_MLA"}
ATTENTION_KERNEL_KEY = "inference.attention_kernel"
PYTORCH_ATTENTION_KERNELS = ("default", "flash", "triton", "cutlass")  # retrain/model/attention_kernels.py
PAGED_ATTENTION_MODES = ("auto", "gather", "flex")  # inference.paged_attention (pytorch engine)
KV_BLOCK_TOKENS = 16  # inference.kv_block_tokens' default: vLLM's block_size


def check_url(url: str, key: str = "inference.url") -> str:
    """`url` without a trailing slash; a clear error naming `key` when it is empty or not http(s)."""
    if not url:
        raise ConfigError(f"{key} is empty: give the server's base url, e.g. {key}=http://127.0.0.1:8000")
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"{key}={url!r} is not an http(s) url, e.g. http://127.0.0.1:8000")
    return url.rstrip("/")


def server_urls(url: Any, key: str = "inference.url") -> list[str]:
    """The servers `url` names, each checked (check_url): one url, several separated by commas, or a list of
    urls (`inference.url=[http://a:8000,http://b:8000]`); a ConfigError naming `key` for an empty or
    repeated one."""
    if isinstance(url, str):
        entries = [part.strip() for part in url.split(",")] if url else [""]
    elif isinstance(url, Sequence) and url:
        entries = list(url)
    else:
        raise ConfigError(f"{key}={url!r} is neither a url, comma-separated urls nor a non-empty list of urls")
    urls = []
    for entry in entries:
        if not isinstance(entry, str):
            raise ConfigError(f"{key}: {entry!r} is not a url (a string such as http://127.0.0.1:8000)")
        urls.append(check_url(entry, key))
    repeated = sorted({u for u in urls if urls.count(u) > 1})
    if repeated:
        raise ConfigError(f"{key} names {', '.join(repeated)} more than once: list each server once")
    return urls


def check_pytorch_attention_kernel(kernel: str) -> None:
    """ConfigError naming the key for a name that is no kernel of the pytorch engine (whatever the machine)."""
    if kernel == "tk":
        raise ConfigError(
            f"{ATTENTION_KERNEL_KEY}=tk: transformers has no ThunderKittens attention for inference=pytorch; "
            f"choose one of {', '.join(PYTORCH_ATTENTION_KERNELS)}"
        )
    if kernel not in PYTORCH_ATTENTION_KERNELS:
        raise ConfigError(f"{ATTENTION_KERNEL_KEY}={kernel!r} is not one of {', '.join(PYTORCH_ATTENTION_KERNELS)}")


def check_request_limits(timeout_s: float, max_retries: int, max_concurrency: int) -> None:
    """The limits of an inference server's client (`inference.*`), for the schema and the client alike."""
    if not timeout_s > 0:
        raise ConfigError(f"inference.timeout_s must be > 0, got {timeout_s}")
    if max_retries < 0:
        raise ConfigError(f"inference.max_retries must be >= 0, got {max_retries}")
    if max_concurrency < 1:
        raise ConfigError(f"inference.max_concurrency must be >= 1, got {max_concurrency}")


@dataclass
class EngineConfig:
    """Keys every engine takes."""

    _partial_: bool = True
    # Test hook: the engine skips pushing new weights, so the freshness proof can be seen to fire.
    # Never set it in a real run: the run stops with StaleWeightsError after the first step.
    fault_skip_weight_sync: bool = False


@dataclass
class PytorchEngineConfig(EngineConfig):
    """In-process engine on the training model itself (no second copy of the base model)."""

    _target_: str = "retrain.inference.pytorch.PytorchEngine"
    prefix_caching: bool = True  # prefill each prompt once and repeat its KV cache G times
    merge_lora: bool = True  # fp32 models: sample through W + s·B·A, a copy of the adapted weights (faster)
    attention_kernel: str = "default"  # default | flash | triton | cutlass (CUDA): retrain/model/attention_kernels.py
    # bound on the KV cache's memory; 0 = automatic: what the device has free after weights, training state
    # and a margin (the memory plan). Rows that do not fit wait and enter as others finish.
    kv_cache_gb: float = 0.0
    # decode steps between the host's reads of which rows met a stop token; 0 = automatic: 8 on a GPU, where a
    # read waits for the device, 1 elsewhere. A row that stopped decodes up to this many - 1 tokens more, unused
    stop_check_steps: int = 0
    # how attention reads cached keys and values: flex (the pool itself, through the block tables: no copy) |
    # gather (a dense copy per layer, then sdpa) | auto: flex on a GPU with triton, else gather. docs/inference-engines.md
    paged_attention: str = "auto"
    # record each row bucket's decode forward as a CUDA graph once per call and replay it: one launch a step, not
    # one per op (needs CUDA and flex paged attention); null = automatic: on where it can be
    cuda_graphs: bool | None = None
    # token slots a block of the KV pool holds (vLLM's block_size): a power of two >= 16. A row's last block keeps
    # up to this many - 1 slots empty; flex_attention's decode kernel reads keys in tiles no larger than a block
    kv_block_tokens: int = KV_BLOCK_TOKENS

    def __post_init__(self) -> None:
        check_pytorch_attention_kernel(self.attention_kernel)
        if self.kv_block_tokens < 16 or self.kv_block_tokens & (self.kv_block_tokens - 1):
            raise ConfigError(f"inference.kv_block_tokens must be a power of two >= 16, got {self.kv_block_tokens}")
        if self.paged_attention not in PAGED_ATTENTION_MODES:
            raise ConfigError(
                f"inference.paged_attention={self.paged_attention!r}: choose one of {', '.join(PAGED_ATTENTION_MODES)}"
            )
        if self.stop_check_steps < 0:
            raise ConfigError(f"inference.stop_check_steps must be >= 0 (0 = automatic), got {self.stop_check_steps}")
        if not self.kv_cache_gb >= 0:
            raise ConfigError(f"inference.kv_cache_gb must be >= 0 (0 = automatic), got {self.kv_cache_gb}")


@dataclass
class VllmEngineConfig(EngineConfig):
    """In-process `vllm.LLM` on the backend's device, serving each step's adapter as `policy-v{N}`."""

    _target_: str = "retrain.inference.vllm.VllmEngine"
    dtype: str = "auto"  # auto (the training dtype) | bf16 | fp16 | fp32 | fp8 | fp4 (quantized serving)
    kv_cache_dtype: str = "auto"  # auto | bf16 | fp8 | int8
    prefix_caching: bool = True  # share prompt KV across a group's completions (and across steps of one version)
    attention_kernel: str = (
        "default"  # default | flash | triton | tk | cutlass (vLLM attention backends where one exists)
    )
    gpu_memory_utilization: float = 0.35  # share of GPU memory for weights + KV cache (training shares the GPU)
    max_model_len: int = 0  # 0 = prompt budget + training.max_tokens, capped by the model's own limit
    max_lora_rank: int = 0  # 0 = model.lora_rank, rounded up to a rank vLLM supports
    sleep_mode: bool = True  # on CUDA: free the engine's memory while training runs
    enforce_eager: bool = False  # skip CUDA-graph capture and torch.compile (faster start, slower decode)
    merge_lora: bool = False  # push W + s·B·A into vLLM's weights instead of serving an adapter (no LoRA kernels)

    def __post_init__(self) -> None:
        if self.dtype == "fp4":
            raise ConfigError(
                "inference.dtype=fp4: vLLM serves fp4 only from a checkpoint quantized ahead of time "
                "(e.g. NVFP4 with ModelOpt); point model.name_or_path at one and keep inference.dtype=auto"
            )
        if self.dtype != "auto" and self.dtype not in {**VLLM_WEIGHT_DTYPES, **VLLM_QUANTIZED_DTYPES}:
            raise ConfigError(f"inference.dtype={self.dtype!r} is not one of auto, bf16, fp16, fp32, fp8, fp4")
        if self.kv_cache_dtype not in VLLM_KV_CACHE_DTYPES:
            raise ConfigError(
                f"inference.kv_cache_dtype={self.kv_cache_dtype!r} is not one of {', '.join(VLLM_KV_CACHE_DTYPES)}"
            )
        if self.attention_kernel == "tk":
            raise ConfigError("inference.attention_kernel=tk: vLLM has no ThunderKittens attention backend")
        if self.attention_kernel not in VLLM_ATTENTION_BACKENDS:
            raise ConfigError(
                f"inference.attention_kernel={self.attention_kernel!r} is not one of default, flash, triton, tk, cutlass"
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"inference.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_model_len < 0:
            raise ConfigError(f"inference.max_model_len must be >= 0 (0 = the model's limit), got {self.max_model_len}")
        if self.max_lora_rank < 0:
            raise ConfigError(f"inference.max_lora_rank must be >= 0 (0 = model.lora_rank), got {self.max_lora_rank}")


@dataclass
class HttpEngineConfig(EngineConfig):
    """Keys every engine that samples on a server takes (retrain.inference.http)."""

    # the server's base url, e.g. http://127.0.0.1:8000 (required); several servers: a list of urls, or urls
    # separated by commas; groups go round-robin over them by their index in the step's batch
    url: Any = ""
    api_key_env: str = ""  # environment variable holding the server's API key ('' = none)
    timeout_s: float = 600.0  # per request, sending to last byte: a step's longest generation must fit
    max_retries: int = 5  # on 429/5xx and failed connections, with exponential backoff and jitter
    max_concurrency: int = 64  # requests in flight at once
    max_reply_mb: float = 64.0  # largest reply read (decompressed); a larger one fails the request

    def __post_init__(self) -> None:
        server_urls(self.url)
        check_request_limits(self.timeout_s, self.max_retries, self.max_concurrency)
        if not self.max_reply_mb > 0:
            raise ConfigError(f"inference.max_reply_mb must be > 0, got {self.max_reply_mb}")


@dataclass
class VllmServerEngineConfig(HttpEngineConfig):
    """A running vLLM server (`/v1/completions`), following training through runtime LoRA loading."""

    _target_: str = "retrain.inference.vllm_server.VllmServerEngine"
    adapter_root: str = ""  # where each step's adapter is written ('' = a temp dir); the server must read it


@dataclass
class SglangEngineConfig(HttpEngineConfig):
    """A running SGLang server (native `/generate`), following training through runtime LoRA loading."""

    _target_: str = "retrain.inference.sglang.SglangEngine"
    adapter_root: str = ""  # where each step's adapter is written ('' = a temp dir); the server must read it


@dataclass
class OpenAIEngineConfig(HttpEngineConfig):
    """Any OpenAI-compatible `/v1/completions` server (MAX, MLX-LM, TRT-LLM): frozen weights without a LoRA route."""

    _target_: str = "retrain.inference.openai_server.OpenAIEngine"
    api_key_env: str = "OPENAI_API_KEY"
    model: str = ""  # the served model to sample ('' = the first that /v1/models lists)
    adapter_root: str = ""  # where each step's adapter is written, when the server has a LoRA load route


SCHEMAS: dict[str, type] = {
    "base_pytorch": PytorchEngineConfig,
    "base_vllm": VllmEngineConfig,
    "base_vllm_server": VllmServerEngineConfig,
    "base_sglang": SglangEngineConfig,
    "base_openai": OpenAIEngineConfig,
}
