"""A run's memory per device, predicted from the model's config.json before any weight loads.

Parts and when they live (docs/capacity-planning.md, "Memory"):
- resident (the whole run): base weights; the LoRA adapter (fp32: PEFT keeps adapters of bf16/fp16 models in
  fp32) with its gradients and AdamW's two moments; for an fp32 model sampled by `inference=pytorch` with
  `merge_lora`, the merged copies W + s·B·A of the adapted weights; vLLM's share when it does not sleep.
- sampling (one `generate`): the KV cache at its budget and the decode step's [rows, vocab] fp32 logits and
  the copies the sampler makes of them; vLLM's share (`gpu_memory_utilization` × device) for `inference=vllm`.
- training (one micro-batch of `backend.micro_batch_tokens` padded tokens): the activations autograd saves for
  backward (`saved_bytes_per_token_layer`, checked against autograd's own saved tensors), or with gradient
  checkpointing each layer's input plus one layer's; and the LM head's fp32 logits chunk
  (`LOGITS_CHUNK_BYTES`) with its backward.

The KV cache of the in-process sampler lives within one `generate`, so a device's peak is the resident parts
plus the larger of the two phases. Split mode (`backend.devices=gpu:I,gpu:T`) gives the inference device a copy
of the weights (and adapter), the KV cache and the decode logits, the training device the rest.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from retrain.inference.config import KV_BLOCK_TOKENS
from retrain.inference.sampler.kv_budget import blocks_holding, rows_held
from retrain.inference.sampler.paged_attention import block_mask_bytes, row_bucket
from retrain.model.config_files import model_config, params_from_config
from retrain.model.lean_decoder import MIRRORED
from retrain.model.logprobs import LOGITS_CHUNK_BYTES

GIB = 2**30
# the prompt length the plan assumes (the data's prompts are only tokenized once the tokenizer loads): chat-
# templated math and GSM8K problems are ~100-300 tokens; capped by the model's context less max_tokens
PROMPT_TOKENS_ESTIMATE = 512
FP32 = 4
LORA_BYTES = FP32  # PEFT keeps LoRA weights in fp32 even on a bf16/fp16 model (autocast_adapter_dtype)
ADAMW_STATE_PER_PARAM = 2  # exp_avg and exp_avg_sq
# fp32 [rows, vocab] tensors alive at once in one decode step: the scaled log-softmax, its exp, the cumulative
# sum of the draw (top-p adds a sorted copy and its order) and the logits themselves
DECODE_LOGITS_COPIES = 4
# fp32 [tokens, vocab] tensors of one logits chunk at its backward (the chunk, its scaled copy, its softmax and
# its gradient): measured ~4x the chunk (tests/inference/test_logits_chunks.py's subprocess measurement)
LOGITS_CHUNK_COPIES = 4
# what the plan keeps free of a device's memory: allocator fragmentation, CUDA's context and kernels' workspaces
MARGIN_FRACTION = 0.05
CUDA_RESERVE_BYTES = 1 * GIB
# the GPU sizes `retrain explain` checks a plan against on a machine without that GPU (GB as GPUs are sold)
GPU_SIZES_GB = (24, 48, 80, 141)
KNOBS = {
    "kv": "inference.kv_cache_gb",
    "micro_batch": "backend.micro_batch_tokens",
    "checkpointing": "backend.gradient_checkpointing=true",
}


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs of a dense decoder's config.json."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    params: float
    context: int | None
    model_type: str = ""
    activation: str = "silu"  # hidden_act

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ModelShape:
        """From a Hugging Face config (a multimodal wrapper's `text_config`); ValueError naming what is missing."""
        text = config.get("text_config", config)
        params = params_from_config(config)
        if params is None:
            raise ValueError("config.json lacks hidden_size, num_hidden_layers, intermediate_size, vocab_size or heads")
        heads = int(text["num_attention_heads"])
        hidden = int(text["hidden_size"])
        context = text.get("max_position_embeddings")
        return cls(
            hidden=hidden,
            layers=int(text["num_hidden_layers"]),
            heads=heads,
            kv_heads=int(text.get("num_key_value_heads") or heads),
            head_dim=int(text.get("head_dim") or hidden // heads),
            intermediate=int(text["intermediate_size"]),
            vocab=int(text["vocab_size"]),
            params=params,
            context=int(context) if isinstance(context, int) and context > 0 else None,
            model_type=str(text.get("model_type") or config.get("model_type") or ""),
            activation=str(text.get("hidden_act") or "silu"),
        )

    def projections(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each LoRA-adaptable linear of a layer."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        h, i = self.hidden, self.intermediate
        return {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    def lora_params(self, rank: int, targets: Sequence[str]) -> int:
        """Trainable parameters of a rank-`rank` adapter on `targets` (A: rank × in, B: out × rank, every layer)."""
        shapes = self.projections()
        return self.layers * sum(rank * sum(shapes[t]) for t in targets if t in shapes)

    def adapted_weights(self, targets: Sequence[str]) -> int:
        """Elements of the base weights the adapter adapts (what a merged copy holds)."""
        shapes = self.projections()
        return self.layers * sum(shapes[t][0] * shapes[t][1] for t in targets if t in shapes)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """One token's keys and values in every layer."""
        return self.layers * self.kv_heads * self.head_dim * 2 * dtype_bytes


def fused_norms(on_gpu: bool, model_type: str) -> bool:
    """Whether the training forward's norms are torch's rms_norm fused under autograd: the lean forward's
    (retrain/model/lean_decoder.py: the model types it mirrors, without checkpointing) on CUDA, where torch has the
    fused kernels (recent torch: the op `_fused_rms_norm_backward`). A CPU runs rms_norm's composite, and
    transformers' forward its RMSNorm modules' ops: both keep an fp32 copy of the input."""
    return on_gpu and model_type in MIRRORED and hasattr(torch.ops.aten, "_fused_rms_norm_backward")


def fuses_mlp(setting: str, on_gpu: bool, shape: ModelShape) -> bool:
    """Whether the training forward runs SiLU·up as one compiled kernel (`backend.fused_elementwise`, auto: on a GPU,
    retrain/model/fused_elementwise.py): the lean forward's, of a SiLU MLP."""
    fused = setting == "true" or (setting == "auto" and on_gpu)
    return fused and shape.model_type in MIRRORED and shape.activation == "silu"


def saved_bytes_per_token_layer(
    shape: ModelShape,
    dtype_bytes: int,
    rank: int,
    targets: Sequence[str],
    sequence_tokens: int = 0,
    fused: bool = False,
    fused_mlp: bool = False,
) -> int:
    """Bytes autograd saves per token in one LoRA-adapted decoder layer for backward (base weights frozen).

    A frozen base linear saves nothing of its input (its weight gives the input's gradient). A LoRA linear saves
    its input (the linears reading one input share it; o_proj's is the output attention saves) and A's rank-r
    output, in the model's dtype: a bf16/fp16 model's fp32 adapters are cast to it for the branch
    (retrain/model/merged_lora.py), so nothing per token is saved in fp32 there. RMSNorm saves its input and one
    fp32 rstd per row (the two layer norms, q_norm and k_norm per head): the input in the model's dtype where the
    norms run `fused` (`fused_norms`), else an fp32 copy. Attention saves q and k after RoPE, v, its output and
    one log-sum-exp per head, plus the padding mask sdpa makes of a padded batch
    (`sequence_tokens` keys per token, in the model's dtype, per layer). The gated MLP saves gate's output (SiLU's
    input), SiLU's and up's outputs and down's input; SiLU·up compiled as one kernel (`fused_mlp`:
    retrain/model/fused_elementwise.py) keeps gate's and up's outputs only, and recomputes SiLU in backward. Matches autograd's saved tensors exactly on Qwen3
    (tests/test_memory_plan.py).
    """
    h, i = shape.hidden, shape.intermediate
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    b = dtype_bytes
    adapted = set(targets) & set(shape.projections())

    def inputs(width: int, names: tuple[str, ...]) -> int:
        """The input the adapters of `names`, reading one `width`-wide input, save (once, shared)."""
        return width * b * min(len(adapted & set(names)), 1)

    norm_input = b if fused else FP32
    norms = 2 * (h * norm_input + FP32) + (q + kv) * norm_input + (shape.heads + shape.kv_heads) * FP32
    attention = (q + 2 * kv) * b + q * b + shape.heads * FP32 + sequence_tokens * b
    mlp = (2 if fused_mlp else 3) * i * b
    adapters = (
        inputs(h, ("q_proj", "k_proj", "v_proj"))
        + inputs(h, ("gate_proj", "up_proj"))
        + inputs(i, ("down_proj",))
        + len(adapted) * rank * b
    )
    return norms + attention + mlp + adapters


def adapter_cast_bytes(shape: ModelShape, dtype_bytes: int, rank: int, targets: Sequence[str]) -> int:
    """The LoRA adapters cast to a bf16/fp16 model's dtype for the training forward, which autograd keeps for
    backward (retrain/model/merged_lora.py): the adapter's size in that dtype, whatever the tokens; none in fp32."""
    return 0 if dtype_bytes == FP32 else shape.lora_params(rank, targets) * dtype_bytes


@dataclass(frozen=True)
class MemoryInputs:
    """What of a run's config the plan reads (`MemoryInputs.of` a composed config)."""

    batch_size: int  # prompts a step
    rows: int  # batch_size × group_size
    prompt_tokens: int
    prompt_source: str  # "estimate" (PROMPT_TOKENS_ESTIMATE, capped by the context) or "given"
    max_tokens: int
    lora_rank: int
    targets: tuple[str, ...]
    dtype: str  # model.dtype: auto | bf16 | fp16 | fp32
    micro_batch_tokens: int  # 0: all rows at once
    checkpointing: str  # auto | true | false
    fused_elementwise: str  # auto | true | false
    engine: str  # pytorch | vllm | other (an engine on a server: nothing on this machine's devices)
    kv_cache_gb: float  # inference=pytorch's budget; 0 = automatic
    paged_attention: str  # inference=pytorch: auto | gather | flex
    kv_block_tokens: int  # inference=pytorch: token slots a block of the KV pool holds
    cuda_graphs: bool | None  # inference=pytorch: decode steps recorded as CUDA graphs; None: automatic
    merge_lora: bool  # inference=pytorch: an fp32 model samples through merged weights
    vllm_share: float  # inference=vllm: gpu_memory_utilization
    vllm_sleeps: bool  # inference=vllm: sleep_mode (CUDA): its memory is free while training runs
    devices: str  # backend.devices

    @classmethod
    def of(cls, config: Mapping[str, Any], shape: ModelShape, prompt_tokens: int | None = None) -> MemoryInputs:
        """From a composed config (plain containers, resolved); `prompt_tokens` when the prompts are known."""
        training, backend, model, inference = (
            config["training"],
            config["backend"],
            config["model"],
            config["inference"],
        )
        target = str(inference.get("_target_", ""))
        engine = (
            "pytorch" if target.endswith("PytorchEngine") else "vllm" if target.endswith(".VllmEngine") else "other"
        )
        max_tokens = int(training["max_tokens"])
        source = "given"
        if prompt_tokens is None:
            room = PROMPT_TOKENS_ESTIMATE if shape.context is None else shape.context - max_tokens
            prompt_tokens, source = max(1, min(PROMPT_TOKENS_ESTIMATE, room)), "estimate"
        return cls(
            batch_size=int(training["batch_size"]),
            rows=int(training["batch_size"]) * int(training["group_size"]),
            prompt_tokens=prompt_tokens,
            prompt_source=source,
            max_tokens=max_tokens,
            lora_rank=int(model["lora_rank"]),
            targets=tuple(model["target_modules"]),
            dtype=str(model.get("dtype", "auto")),
            micro_batch_tokens=int(backend.get("micro_batch_tokens", 0)),
            checkpointing=str(backend.get("gradient_checkpointing", "false")).lower(),
            fused_elementwise=str(backend.get("fused_elementwise", "false")).lower(),
            engine=engine,
            kv_cache_gb=float(inference.get("kv_cache_gb", 0.0)),
            paged_attention=str(inference.get("paged_attention", "auto")),
            kv_block_tokens=int(inference.get("kv_block_tokens", KV_BLOCK_TOKENS)),
            cuda_graphs=inference.get("cuda_graphs"),
            merge_lora=bool(inference.get("merge_lora", False)),
            vllm_share=float(inference.get("gpu_memory_utilization", 0.0)),
            vllm_sleeps=bool(inference.get("sleep_mode", False)),
            devices=str(backend.get("devices", "cpu")),
        )

    @property
    def row_tokens(self) -> int:
        return self.prompt_tokens + self.max_tokens


@dataclass(frozen=True)
class Part:
    """One thing a device holds."""

    name: str
    phase: str  # resident | sampling | training
    bytes: int
    detail: str


@dataclass(frozen=True)
class DeviceMemory:
    """One device's parts and its predicted peak: the resident parts plus the larger phase."""

    device: str  # cpu | gpu:N
    role: str  # "sampling and training", "sampling" or "training"
    total_bytes: int | None  # the device's memory; None when planned without one
    parts: tuple[Part, ...]
    overlapped: bool = False  # split mode on one memory ("cpu,cpu"): sampling runs while training does

    def phase_bytes(self, phase: str) -> int:
        return sum(part.bytes for part in self.parts if part.phase == phase)

    @property
    def peak_bytes(self) -> int:
        sampling, training = self.phase_bytes("sampling"), self.phase_bytes("training")
        return self.phase_bytes("resident") + (sampling + training if self.overlapped else max(sampling, training))

    @property
    def usable_bytes(self) -> int | None:
        """The device's memory less the margin the plan keeps free."""
        if self.total_bytes is None:
            return None
        return usable(self.total_bytes, self.device)

    @property
    def fits(self) -> bool | None:
        return None if self.usable_bytes is None else self.peak_bytes <= self.usable_bytes


@dataclass(frozen=True)
class MemoryPlan:
    """The run's memory, device by device, and what the plan decided (checkpointing, the KV budget)."""

    inputs: MemoryInputs
    devices: tuple[DeviceMemory, ...]
    dtype: str  # the weights' dtype on the planned device (auto resolved)
    checkpointing: bool  # resolved: auto is on when activations would not fit otherwise
    kv_budget_bytes: int  # the KV cache's budget (0: the engine keeps none on this machine)
    kv_full_bytes: int  # what all rows at full length need
    rows_at_once: int  # rows the budget holds at full length; the rest wait for a finished row's room
    micro_batch_tokens: int  # padded tokens per training forward (a longer row alone)
    notes: tuple[str, ...] = field(default=())

    @property
    def fits(self) -> bool | None:
        """Whether every device holds its peak. A KV budget that holds no row at the planned row length is no
        refusal: the prompts' lengths are estimated here, and the sampler refuses a budget that cannot hold the
        longest real row, naming `inference.kv_cache_gb` (retrain/inference/sampler/kv_budget.py)."""
        verdicts = [device.fits for device in self.devices]
        return None if None in verdicts else all(verdicts)

    def problem(self) -> str | None:
        """Why the run cannot fit, naming the knob that fixes it; None when it fits (or no device size is known)."""
        for device in self.devices:
            if device.fits is not False:
                continue
            assert device.usable_bytes is not None
            over = device.peak_bytes - device.usable_bytes
            return (
                f"the memory plan needs {gib(device.peak_bytes)} on {device.device} ({device.role}) but "
                f"{gib(device.usable_bytes)} is usable (of {gib(device.total_bytes or 0)}): {gib(over)} too much; "
                f"{self.fix(device)}"
            )
        return None

    def fix(self, device: DeviceMemory) -> str:
        """The knob that brings `device` under its memory, the largest part first."""
        resident = device.phase_bytes("resident")
        sampling, training = device.phase_bytes("sampling"), device.phase_bytes("training")
        if device.usable_bytes is not None and resident >= device.usable_bytes:
            return "the weights alone do not fit: use a device with more memory, a smaller model or model.dtype=bf16"
        if sampling >= training and self.inputs.engine == "pytorch":
            return f"lower {KNOBS['kv']} (rows then wait for room as others finish), now {gib(self.kv_budget_bytes)}"
        if sampling >= training and self.inputs.engine == "vllm":
            return "lower inference.gpu_memory_utilization"
        if not self.checkpointing:
            return f"set {KNOBS['checkpointing']}, or lower {KNOBS['micro_batch']}"
        return f"lower {KNOBS['micro_batch']} (now {self.micro_batch_tokens})"

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for device, entry in zip(self.devices, data["devices"]):
            entry.update(
                peak_bytes=device.peak_bytes,
                usable_bytes=device.usable_bytes,
                fits=device.fits,
                phases={phase: device.phase_bytes(phase) for phase in ("resident", "sampling", "training")},
            )
        data["fits"] = self.fits
        data["problem"] = self.problem()
        return data

    def table(self) -> str:
        """The plan as text: one block per device, a line per part, the peak and whether it fits."""
        inputs = self.inputs
        lines = [
            f"Memory plan ({self.dtype} weights, {inputs.rows} rows of {inputs.prompt_tokens} prompt "
            f"({inputs.prompt_source}) + {inputs.max_tokens} new tokens; gradient checkpointing "
            f"{'on' if self.checkpointing else 'off'}" + (" (auto)" if inputs.checkpointing == "auto" else "") + ")"
        ]
        for device in self.devices:
            size = "size unknown" if device.total_bytes is None else f"{gib(device.total_bytes)}"
            lines.append(f"  {device.device} ({device.role}, {size}):")
            for part in device.parts:
                lines.append(f"    {part.name:<27} {part.phase:<9} {gib(part.bytes):>10}  {part.detail}")
            verdict = "" if device.fits is None else ("  fits" if device.fits else "  DOES NOT FIT")
            usable_text = "" if device.usable_bytes is None else f" of {gib(device.usable_bytes)} usable"
            lines.append(
                f"    {'peak':<27} {'':<9} {gib(device.peak_bytes):>10}  resident + max(sampling, training)"
                f"{usable_text}{verdict}"
            )
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)


def gib(value: float) -> str:
    """Bytes as GiB, or MiB below one GiB."""
    return f"{value / GIB:.2f} GiB" if abs(value) >= GIB else f"{value / 2**20:.1f} MiB"


def usable(total_bytes: int, device: str) -> int:
    """What the plan may fill of a device: its memory less a margin (and CUDA's context on a GPU)."""
    reserve = CUDA_RESERVE_BYTES if device.startswith("gpu") else 0
    return int(total_bytes * (1 - MARGIN_FRACTION)) - reserve


def device_names(devices: str) -> tuple[str, ...]:
    """`backend.devices` as its entries: one, or two in split mode (inference first)."""
    return tuple(spec.strip() for spec in devices.split(",") if spec.strip()) or ("cpu",)


def weight_bytes(dtype: str) -> int:
    return {"bf16": 2, "fp16": 2, "fp32": 4}[dtype]


def resolved_dtype(dtype: str, on_gpu: bool) -> str:
    """`model.dtype` as the backend resolves it (retrain.model.spec.ModelSpec.torch_dtype)."""
    return dtype if dtype != "auto" else ("bf16" if on_gpu else "fp32")


def plan_memory(
    shape: ModelShape, inputs: MemoryInputs, device_bytes: Sequence[int | None], on_gpu: bool
) -> MemoryPlan:
    """The plan for `inputs` on the memories `device_bytes` (one per device the run uses: two GPUs in split
    mode, else one; None: unknown). `on_gpu`: whether they are GPUs (what dtype `auto` resolves to, CUDA's
    reserve). Checkpointing `auto` is on when the training phase would not fit without it; the automatic KV
    budget (`inference.kv_cache_gb=0`) is what the sampling device has left after its resident parts, the
    decode logits and the margin, capped at what all rows at full length need."""
    names = device_names(inputs.devices)
    split = len(names) == 2
    two_memories = split and on_gpu  # "cpu,cpu": split mode on one memory
    names = names if two_memories else (names[-1] if on_gpu else "cpu",)
    if len(device_bytes) != len(names):
        raise ValueError(f"{len(device_bytes)} device memories for {len(names)} device(s) {names}")
    dtype = resolved_dtype(inputs.dtype, on_gpu)
    b = weight_bytes(dtype)
    notes: list[str] = []

    lora = shape.lora_params(inputs.lora_rank, inputs.targets)
    weights = Part("base weights", "resident", int(shape.params * b), f"{shape.params / 1e6:,.1f}M params × {b} B")
    adapter = Part(
        "LoRA + grads + AdamW",
        "resident",
        lora * LORA_BYTES * (2 + ADAMW_STATE_PER_PARAM),
        f"{lora / 1e6:,.2f}M params × 4 B × (weight, grad, 2 moments)",
    )
    sampler: list[Part] = []  # what the sampler adds on its device
    if split and inputs.engine == "pytorch":  # the in-process engine's copy of the model on its own device
        sampler += [
            Part("base weights (copy)", "resident", weights.bytes, "split mode: the sampler's own copy"),
            Part("LoRA weights (copy)", "resident", lora * LORA_BYTES, "split mode: synced after each step"),
        ]
    if inputs.engine == "pytorch" and inputs.merge_lora and dtype == "fp32":
        merged = shape.adapted_weights(inputs.targets) * FP32
        sampler.append(Part("merged LoRA weights", "resident", merged, "inference.merge_lora: W + s·B·A per target"))

    # training: one micro-batch of padded tokens (a row longer than the budget goes alone)
    row = inputs.row_tokens
    micro = max(min(inputs.micro_batch_tokens or inputs.rows * row, inputs.rows * row), row)
    rows_per_micro = min(inputs.rows, micro // row)
    # without checkpointing the trainer runs each prompt of a micro-batch once for its rows (as documents, packed,
    # or as a shared prefill); with it, the prefill's KV cache is not kept, and where the rows are neither documents
    # nor packed every row runs prompt + completion (retrain.model.logprobs.completion_logprobs): the plan counts that
    shared = min(rows_per_micro, inputs.batch_size) * inputs.prompt_tokens + rows_per_micro * inputs.max_tokens
    whole = rows_per_micro * row
    fused = fused_norms(on_gpu, shape.model_type)
    fused_mlp = fuses_mlp(inputs.fused_elementwise, on_gpu, shape)
    # checkpointed, a layer recomputes through the same forward: what it saves is one layer's `per_layer`
    per_layer = saved_bytes_per_token_layer(shape, b, inputs.lora_rank, inputs.targets, row, fused, fused_mlp)
    # only completion tokens reach the LM head (retrain.model.logprobs), in chunks of LOGITS_CHUNK_BYTES fp32 logits
    chunk_tokens = max(1, min(rows_per_micro * inputs.max_tokens, LOGITS_CHUNK_BYTES // (shape.vocab * FP32)))
    logits = Part(
        "logits chunk + backward",
        "training",
        chunk_tokens * shape.vocab * FP32 * LOGITS_CHUNK_COPIES,
        f"{chunk_tokens} tokens × {shape.vocab} vocab × 4 B × {LOGITS_CHUNK_COPIES}",
    )
    casts = adapter_cast_bytes(shape, b, inputs.lora_rank, inputs.targets)
    full = Part(
        "activations",
        "training",
        shared * shape.layers * per_layer + casts,
        f"{shared} tokens × {shape.layers} layers × {per_layer} B"
        + (f", + the adapter in {dtype} ({casts} B)" if casts else ""),
    )
    checkpointed = Part(
        "activations (checkpointed)",
        "training",
        whole * shape.layers * shape.hidden * b + whole * per_layer + casts // shape.layers,
        f"{whole} tokens × {shape.layers} layer inputs × {shape.hidden * b} B, + {per_layer} B/token of the layer recomputed",
    )
    training_memory = device_bytes[-1]
    if inputs.checkpointing == "auto":
        resident = weights.bytes + adapter.bytes + (0 if two_memories else sum(p.bytes for p in sampler))
        room = None if training_memory is None else usable(training_memory, names[-1]) - resident
        checkpointing = room is not None and full.bytes + logits.bytes > room
    else:
        checkpointing = inputs.checkpointing == "true"
    training = [checkpointed if checkpointing else full, logits]

    # sampling: the KV cache at its budget and the decode step's logits
    per_token = shape.kv_bytes_per_token(b)
    block_bytes, row_blocks = inputs.kv_block_tokens * per_token, -(-row // inputs.kv_block_tokens)
    sink = records_decode_steps(inputs, on_gpu)  # the engine's pool then keeps a block no row takes
    full_blocks = blocks_holding(inputs.rows, row_blocks, sink)  # every row at full length
    kv_full = full_blocks * block_bytes
    kv_budget, rows_at_once = 0, inputs.rows
    sampling: list[Part] = []
    if inputs.engine == "pytorch":
        decode = Part(
            "decode logits",
            "sampling",
            inputs.rows * shape.vocab * FP32 * DECODE_LOGITS_COPIES,
            f"{inputs.rows} rows × {shape.vocab} vocab × 4 B × {DECODE_LOGITS_COPIES}",
        )
        attention = attention_part(shape, inputs, b, on_gpu, full_blocks)
        graphs = graphs_part(shape, inputs, on_gpu)
        if inputs.kv_cache_gb > 0:  # a GPU's engine takes all of it at each call (kv_pool.py: `reserve`)
            configured = int(inputs.kv_cache_gb * GIB)
            kv_budget = configured if on_gpu else min(configured, kv_full)
        elif device_bytes[0] is None:
            kv_budget = kv_full
            notes.append("device memory unknown: the KV budget is what all rows at full length need")
        else:
            resident = sum(p.bytes for p in sampler) + (0 if two_memories else weights.bytes + adapter.bytes)
            left = usable(device_bytes[0], names[0]) - resident - decode.bytes - attention.bytes - graphs.bytes
            if split and not two_memories:
                left -= sum(p.bytes for p in training)  # both phases at once in one memory
            kv_budget = max(0, min(left, kv_full))
        rows_at_once = min(inputs.rows, rows_held(kv_budget // block_bytes, row_blocks, sink))
        kv = Part(
            "KV cache",
            "sampling",
            kv_budget,
            f"{per_token} B/token ({shape.layers} layers × {shape.kv_heads} KV heads × {shape.head_dim} × 2 × {b} B); "
            f"{rows_at_once} of {inputs.rows} rows at {row} tokens",
        )
        sampling = [kv, decode, attention, *([graphs] if graphs.bytes else [])]
        if rows_at_once == 0:
            notes.append(
                f"the KV budget holds no row of {row} tokens ({inputs.prompt_source} prompt + max_tokens): the "
                f"sampler checks the longest real row when it samples, and refuses naming {KNOBS['kv']} if it does "
                "not fit"
            )
        elif rows_at_once < inputs.rows:
            notes.append(
                f"the KV budget holds {rows_at_once} of {inputs.rows} rows at full length: the others wait for room "
                f"as rows finish ({KNOBS['kv']} sets it)"
            )
    elif inputs.engine == "vllm":
        phase = "sampling" if inputs.vllm_sleeps and on_gpu else "resident"
        share = 0 if device_bytes[0] is None else int(inputs.vllm_share * device_bytes[0])
        detail = f"inference.gpu_memory_utilization={inputs.vllm_share} × device memory"
        sampling = [
            Part("vLLM share", phase, share, detail + ("" if phase == "resident" else "; asleep while training"))
        ]
        if device_bytes[0] is None:
            notes.append("device memory unknown: vLLM's share of it is not counted")
    else:
        notes.append("the inference engine is a server's: none of its memory is on these devices")

    devices: tuple[DeviceMemory, ...]
    if two_memories:
        devices = (
            DeviceMemory(names[0], "sampling", device_bytes[0], (*sampler, *sampling)),
            DeviceMemory(names[1], "training", device_bytes[1], (weights, adapter, *training)),
        )
    else:
        parts = (weights, adapter, *sampler, *sampling, *training)
        devices = (DeviceMemory(names[0], "sampling and training", device_bytes[0], parts, overlapped=split),)
    return MemoryPlan(
        inputs=inputs,
        devices=devices,
        dtype=dtype,
        checkpointing=checkpointing,
        kv_budget_bytes=kv_budget,
        kv_full_bytes=kv_full,
        rows_at_once=rows_at_once,
        micro_batch_tokens=micro,
        notes=tuple(notes),
    )


def graphs_part(shape: ModelShape, inputs: MemoryInputs, on_gpu: bool) -> Part:
    """What recorded decode steps (`inference.cuda_graphs`, automatic on a GPU with flex attention) hold while a call
    samples: each row bucket's fp32 [bucket, vocab] logits, the graph's own output (buckets of 8, 16, 32 ... rows:
    together less than twice the largest). Their intermediates are those of the eager step, counted already."""
    if not records_decode_steps(inputs, on_gpu):
        return Part("decode graphs", "sampling", 0, "decode steps run eagerly")
    largest = row_bucket(inputs.rows)
    return Part(
        "decode graphs",
        "sampling",
        2 * largest * shape.vocab * FP32,
        f"each row bucket's logits, up to {largest} rows × {shape.vocab} vocab × 4 B, < 2× that in all",
    )


def records_decode_steps(inputs: MemoryInputs, on_gpu: bool) -> bool:
    """Whether the engine records its decode steps (`inference.cuda_graphs`, automatic on a GPU with flex)."""
    return on_gpu and pages_with_flex(inputs, on_gpu) and inputs.cuda_graphs is not False


def pages_with_flex(inputs: MemoryInputs, on_gpu: bool) -> bool:
    """Whether decode attends through flex_attention (`inference.paged_attention`, auto: flex on a GPU)."""
    return inputs.paged_attention == "flex" or (inputs.paged_attention == "auto" and on_gpu)


def attention_part(shape: ModelShape, inputs: MemoryInputs, dtype_bytes: int, on_gpu: bool, pool_blocks: int) -> Part:
    """What a decode step's attention adds beside the KV pool: flex, the block mask over the pool's blocks (at most
    `pool_blocks`, all rows at full length); gather, one layer's live keys and values copied out of the pool for
    every row."""
    if pages_with_flex(inputs, on_gpu):
        return Part(
            "paged attention (flex)",
            "sampling",
            block_mask_bytes(inputs.rows, pool_blocks),
            f"the block mask: {inputs.rows} rows × {pool_blocks} pool blocks at most",
        )
    per_layer = shape.kv_bytes_per_token(dtype_bytes) // shape.layers
    tokens = inputs.rows * inputs.row_tokens
    return Part(
        "paged attention (gather)",
        "sampling",
        tokens * per_layer,
        f"one layer's keys and values copied out of the pool: {tokens} tokens × {per_layer} B",
    )


def plans_local_memory(config: Mapping[str, Any]) -> bool:
    """Whether the run trains on this machine's devices (backend=local), so a memory plan applies."""
    return str(config["backend"].get("_target_", "")) == "retrain.backend.local.LocalBackend"


def plan_for(
    config: Mapping[str, Any], device_bytes: Sequence[int | None], on_gpu: bool, prompt_tokens: int | None = None
) -> MemoryPlan | None:
    """The plan of a composed config (plain containers) on devices of `device_bytes`; None when it trains
    elsewhere or its model's config.json is on neither this machine nor in retrain's shipped configs."""
    if not plans_local_memory(config):
        return None
    model = config["model"]
    found = model_config(str(model["name_or_path"]), model.get("revision"))
    if found is None:
        return None
    try:
        shape = ModelShape.from_config(found)
    except (KeyError, TypeError, ValueError):
        return None
    return plan_memory(shape, MemoryInputs.of(config, shape, prompt_tokens), device_bytes, on_gpu)


def plans_by_gpu_size(config: Mapping[str, Any]) -> dict[int, MemoryPlan]:
    """The plan on each GPU size of GPU_SIZES_GB (every device of the run that size); empty when none applies."""
    devices = device_names(str(config["backend"].get("devices", "cpu")))
    count = 2 if len(devices) == 2 and devices[0] != devices[1] else 1
    plans = {}
    for size in GPU_SIZES_GB:
        plan = plan_for(config, [size * 10**9] * count, on_gpu=True)
        if plan is None:
            return {}
        plans[size] = plan
    return plans


def plan_on_this_machine(config: Mapping[str, Any], local_ranks: int = 1) -> MemoryPlan | None:
    """The plan of a composed config on the devices this machine gives `backend.devices` (None: no plan applies).
    On the CPU, `local_ranks` ranks of one run share the host's memory: each rank's plan gets its share of it (a
    GPU is each rank's own)."""
    from retrain.model.device_memory import device_memories

    if not plans_local_memory(config):
        return None
    memories, on_gpu = device_memories(str(config["backend"].get("devices", "cpu")))
    shared = not on_gpu and local_ranks > 1
    if shared:
        memories = [None if memory is None else memory // local_ranks for memory in memories]
    plan = plan_for(config, memories, on_gpu)
    if plan is None or not shared:
        return plan
    note = f"the host memory is shared by {local_ranks} ranks on this machine: this plan counts 1/{local_ranks} of it"
    return replace(plan, notes=(*plan.notes, note))


def memory_report(config: Mapping[str, Any], local_ranks: int = 1) -> dict[str, Any] | None:
    """What `retrain explain` shows of a composed config's memory: the plan on this machine's devices (shared by
    `local_ranks` ranks on the CPU), or, for GPUs this machine lacks, on the first size of GPU_SIZES_GB it fits; and
    whether and how it fits each size."""
    from retrain.model.device_memory import cuda_available

    if not plans_local_memory(config):
        return None
    wants_gpu = any(spec.startswith("gpu:") for spec in device_names(str(config["backend"].get("devices", "cpu"))))
    by_size = plans_by_gpu_size(config) if wants_gpu else {}
    here = plan_on_this_machine(config, local_ranks) if cuda_available() or not wants_gpu else None
    if here is None and by_size:
        here = next((plan for plan in by_size.values() if plan.fits), by_size[GPU_SIZES_GB[-1]])
    if here is None:
        return None
    size = (here.devices[0].total_bytes or 0) // 10**9
    shown = "this machine" if cuda_available() or not wants_gpu else f"a {size} GB GPU"
    return {
        "shown_on": shown,
        "plan": here.as_dict(),
        "table": here.table(),
        "gpu_sizes": {
            str(size): {
                "fits": plan.fits,
                "peak_bytes": max(device.peak_bytes for device in plan.devices),
                "gradient_checkpointing": plan.checkpointing,
                "kv_budget_bytes": plan.kv_budget_bytes,
                "rows_at_once": plan.rows_at_once,
                "problem": plan.problem(),
            }
            for size, plan in by_size.items()
        },
    }
