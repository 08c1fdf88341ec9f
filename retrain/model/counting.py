"""What a model's forwards dispatch, counted on any device: the instrument of the GPU path's efficiency checks.

On a GPU an eager decode step costs a kernel launch per compute op and a stall per host sync, whatever the
batch; a CPU shows neither, but it dispatches the same ops. `OpCounter` is a TorchDispatchMode that sorts
every op it sees:

- a **compute op** (a kernel on a GPU), by name;
- a **view** (views, aliases, and ops that hand back their input's storage: a `to` or `contiguous` that had
  nothing to do): metadata only, no kernel;
- a **host read**: `item`/`_local_scalar_dense`/`bool`/`int` of a tensor (`is_nonzero`, `equal`), `.tolist()`,
  `.numpy()`, `.cpu()` and `.to("cpu")` (those four may dispatch nothing on a CPU: the methods are wrapped
  while counting): on a GPU each waits for the device. Only a `.to` whose device is the string "cpu" counts:
  device-agnostic code passes its device as a torch.device (`x.to(self.device)`), which on a CPU is the CPU too;
- a **host-built tensor**: `aten.lift_fresh` of a tensor of one dimension or more, what `torch.tensor(list)`,
  `torch.as_tensor(list)` and indexing with a Python list dispatch (a 0-d lift is a Python scalar an op takes
  by value, e.g. `x[i] = 0.0`: no copy on a GPU);
- a **data-dependent shape**: an op whose output size depends on tensor values (`nonzero`, boolean-mask
  indexing, `masked_select`, ...): an implicit host sync on a GPU.

torch's rms_norm, and the rotary embedding and SiLU·up where the training forward fuses them
(retrain/model/fused_elementwise.py), count as the fused kernel a GPU runs each way, where a CPU runs their
composite under autograd (retrain/model/fused_counting.py). For each compute op it also adds up the bytes an eager kernel moves
(the memory its tensor inputs span, plus its output; gathers and scatters count the rows they touch, not the
whole tensor they index), the bytes of the keys and values an attention op reads (plus what the gather that
built them moved, where one did: a dense copy of cached keys and values costs its read and its write before
attention reads it), and the FLOPs of matmuls and attention (torch's flop_counter formulas; attention with `is_causal` counts its causal half, as a causal kernel skips the rest). flex_attention
(a higher-order op: one fused kernel compiled) counts as one compute op that reads the key and value blocks its
block mask lists, per query tile, and does the FLOPs of those; counted, it runs eagerly without the compile its
eager path wraps it in (which refuses a dispatch mode).

`count_decode` wraps a model's decode calls and splits the counts into decode steps: a window closes at the
end of every forward (the LM head's output), and a window that holds exactly one forward, of one new token per
row, is a decode step: its sampling, bookkeeping and forward. Windows with a prefill and the call's tail are
kept apart (`other`), so per-step figures are exact. A decode forward replayed from a recording (a CUDA graph:
retrain/inference/sampler/step_graphs.py) runs uncounted through `replayed`, as the one launch it is on a GPU, and
its step is kept apart too (`replayed_step`). Ops between the first decoder layer's input norm and the
final norm count as the layers'. The lean forward (retrain/model/lean_decoder.py) calls no norm module: there the
layers' ops run from the first layer's query projection to the LM head, the first input norm counted outside
and the final norm inside in its stead (both one rms_norm).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch._ops import HigherOrderOperator
from torch.nn.attention import flex_attention as flex_module
from torch.utils import flop_counter
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from retrain.model.fused_counting import counted_rms_norm
from retrain.model.fused_elementwise import counted_by

aten = torch.ops.aten

HOST_READS = {aten.item, aten._local_scalar_dense, aten.is_nonzero, aten.equal}
# Tensor methods that read a tensor into the host; a CPU tensor's `.cpu()` and `.to("cpu")` dispatch nothing
# outside inference mode, `.tolist()` and `.numpy()` nothing at all, so the methods are wrapped while counting
HOST_READ_METHODS = ("tolist", "numpy", "cpu", "to")
METADATA = {aten.detach, aten.detach_, aten._unsafe_view, aten.alias}  # no kernel, though not marked views
DATA_DEPENDENT = {aten.nonzero, aten.nonzero_static, aten.masked_select, aten.unique_consecutive, aten._unique2}
INDEXING = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}  # data-dependent with a bool mask
ROW_READS = {aten.index_select, aten.embedding, aten.gather, aten.index}  # read what they return
ROW_WRITES = {aten.index_copy_, aten.index_copy, aten.index_put_, aten.index_put, aten.scatter_, aten.scatter}
ATTENTION_FORWARD = {
    aten.scaled_dot_product_attention,
    aten._scaled_dot_product_flash_attention_for_cpu,
    aten._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_efficient_attention,
    aten._scaled_dot_product_cudnn_attention,
}
ATTENTION_BACKWARD = {
    aten._scaled_dot_product_flash_attention_for_cpu_backward,
    aten._scaled_dot_product_flash_attention_backward,
    aten._scaled_dot_product_efficient_attention_backward,
    aten._scaled_dot_product_cudnn_attention_backward,
}


@dataclass
class Counts:
    """What the ops of one stretch of code did."""

    compute: Counter[str] = field(default_factory=Counter)  # compute ops by name
    views: int = 0
    host_reads: Counter[str] = field(default_factory=Counter)  # by kind: item, tolist, numpy, to_cpu
    host_built: int = 0  # tensors built from Python data (torch.tensor(list), ...)
    data_dependent: int = 0  # ops whose output shape depends on values
    bytes_moved: int = 0  # by the compute ops, each reading its inputs and writing its output
    # of those, by the ops without FLOPs counted (elementwise, reductions, copies, gathers), by op name
    plain_bytes_by_op: Counter[str] = field(default_factory=Counter)
    attention_kv_bytes: int = 0  # keys and values the attention ops read, and what the gathers that built them moved
    flops: float = 0.0  # of matmuls and attention
    attention_flops: float = 0.0  # of attention alone
    layer_compute: int = 0  # compute ops inside the decoder layers

    @property
    def compute_ops(self) -> int:
        return sum(self.compute.values())

    @property
    def plain_bytes(self) -> int:
        return sum(self.plain_bytes_by_op.values())

    @property
    def syncs(self) -> int:
        """Host reads, host-built tensors and data-dependent shapes: each a point where a GPU's host waits."""
        return sum(self.host_reads.values()) + self.host_built + self.data_dependent

    def add(self, other: Counts) -> None:
        self.compute.update(other.compute)
        self.views += other.views
        self.host_reads.update(other.host_reads)
        self.host_built += other.host_built
        self.data_dependent += other.data_dependent
        self.bytes_moved += other.bytes_moved
        self.plain_bytes_by_op.update(other.plain_bytes_by_op)
        self.attention_kv_bytes += other.attention_kv_bytes
        self.flops += other.flops
        self.attention_flops += other.attention_flops
        self.layer_compute += other.layer_compute


class OpCounter(TorchDispatchMode):
    """Counts into `counts` (`restart` begins a new window); see the module docstring. Use as a context manager:
    the Tensor methods of HOST_READ_METHODS are wrapped while it is active."""

    supports_higher_order_operators = True  # flex_attention

    def __init__(self) -> None:
        super().__init__()
        self.counts = Counts()
        self.in_layers = False
        self.paused = False  # the counting's own ops (its hooks') are not counted
        self._gathered: dict[int, int] = {}  # storage of a gather's output -> the bytes the gather moved
        self._methods: dict[str, Callable[..., Any]] = {}
        self._eager_flex = False  # flex_attention's own setting, restored on exit
        self._rms_norm: Callable[..., torch.Tensor] = F.rms_norm  # torch's own, restored on exit
        self._fusions = ExitStack()  # the fused chains counted by this counter

    def __enter__(self) -> OpCounter:
        for name in HOST_READ_METHODS:
            self._methods[name] = original = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._host_read(name, original))
        self._eager_flex = flex_module._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG
        flex_module._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = True  # see the module docstring
        self._rms_norm = F.rms_norm
        F.rms_norm = counted_rms_norm(self, self._rms_norm)
        self._fusions.enter_context(counted_by(self))
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self._fusions.close()
        F.rms_norm = self._rms_norm
        flex_module._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = self._eager_flex
        for name, original in self._methods.items():
            setattr(torch.Tensor, name, original)
        self._methods.clear()

    def _host_read(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def read(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if not self.paused and (name != "to" or _to_cpu(args, kwargs)):
                self.counts.host_reads["to_cpu" if name in ("to", "cpu") else name] += 1
            return original(tensor, *args, **kwargs)

        return read

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.paused:
            self._count(func, args, kwargs, out)
        return out

    def restart(self) -> Counts:
        """The counts so far; counting goes on into new ones."""
        counts, self.counts = self.counts, Counts()
        self._gathered.clear()  # a gather feeds the attention of its own forward
        return counts

    def fused(self, name: str, moved: int) -> None:
        """One fused kernel a GPU runs where the CPU ran the ops of its composite (counted paused)."""
        if self.paused:
            return
        counts = self.counts
        counts.compute[name] += 1
        counts.layer_compute += int(self.in_layers)
        counts.bytes_moved += moved
        counts.plain_bytes_by_op[name] += moved

    @contextmanager
    def pausing(self) -> Iterator[None]:
        """Nothing the block runs is counted."""
        paused, self.paused = self.paused, True
        try:
            yield
        finally:
            self.paused = paused

    def _count(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        if isinstance(func, HigherOrderOperator):
            self._count_flex_attention(func, args, out)
            return
        counts, packet = self.counts, func.overloadpacket
        if packet in HOST_READS:
            counts.host_reads["item"] += 1
            return
        if packet is aten.lift_fresh:
            counts.host_built += int(args[0].dim() > 0)
            return
        if packet in DATA_DEPENDENT or (packet in INDEXING and _boolean_index(args)):
            counts.data_dependent += 1
        if _is_view(func, args, out):
            counts.views += 1
            return
        name = str(packet).removeprefix("aten.")
        counts.compute[name] += 1
        counts.layer_compute += int(self.in_layers)
        moved = _bytes_moved(packet, args, out)
        counts.bytes_moved += moved
        if packet in ROW_READS and isinstance(out, torch.Tensor):
            self._gathered[out.untyped_storage().data_ptr()] = moved
        if packet in ATTENTION_FORWARD:
            for keys in args[1:3]:
                built = self._gathered.pop(keys.untyped_storage().data_ptr(), 0)
                counts.attention_kv_bytes += _span_bytes(keys) + built
        flops = _flops(func, packet, args, kwargs, out)
        counts.flops += flops
        if flops == 0:
            counts.plain_bytes_by_op[name] += moved
        if packet in ATTENTION_FORWARD or packet in ATTENTION_BACKWARD:
            counts.attention_flops += flops

    def _count_flex_attention(self, func: HigherOrderOperator, args: tuple[Any, ...], out: Any) -> None:
        """One fused kernel: the queries, the key and value blocks the block mask lists for each query tile (a
        compiled kernel skips the rest), the output; the FLOPs of the scores and sums over those blocks."""
        if func.name() != "flex_attention":
            raise NotImplementedError(f"the op counter does not know the higher-order op {func.name()}")
        query, key, _, _, block_mask = args[:5]
        kv_num_blocks, kv_block_size = block_mask[2], block_mask[-2]
        with self.pausing():  # blocks listed per (row, head, query tile), as one mean over the heads
            kv_tokens = int(kv_num_blocks.sum()) * kv_block_size / kv_num_blocks.shape[1]
        counts = self.counts
        counts.compute["flex_attention"] += 1
        counts.layer_compute += int(self.in_layers)
        kv_bytes = int(kv_tokens * key.shape[1] * key.shape[-1] * key.element_size()) * 2  # keys and values
        counts.attention_kv_bytes += kv_bytes
        counts.bytes_moved += kv_bytes + _span_bytes(query) + _span_bytes(out[0])
        query_tile = block_mask[-3]
        queries_per_tile = min(query_tile, query.shape[2])
        flops = 4.0 * query.shape[1] * queries_per_tile * kv_tokens * query.shape[-1]  # Q·Kᵀ and P·V
        counts.flops += flops
        counts.attention_flops += flops


@dataclass
class DecodeCounts:
    """A call's counts split into decode steps (one new token per row) and the rest."""

    steps: int = 0
    rows: int = 0  # rows over all decode steps: tokens decoded
    live_kv_tokens: int = 0  # over all decode steps: each row's cached tokens, the new one included
    step: Counts = field(default_factory=Counts)  # summed over the decode steps
    other: Counts = field(default_factory=Counts)  # prefills, admissions and the call's tail
    replayed_step: Counts = field(default_factory=Counts)  # summed over the decode steps whose forward was replayed
    replays: int = 0  # those steps (`replayed`)
    # `replayed(replay)`: runs a recorded decode forward as one launch and closes its step; `uncounted()`: a block
    # whose ops and forwards are not counted (a recording, which launches nothing); both set by count_decode
    replayed: Callable[[Callable[[], torch.Tensor]], torch.Tensor] = field(default=lambda replay: replay())
    uncounted: Callable[[], AbstractContextManager[Any]] = field(default=nullcontext)


@contextmanager
def count_decode(model: Any) -> Iterator[DecodeCounts]:
    """Counts what runs in the block, split at the end of each of `model`'s forwards (a transformers causal LM,
    PEFT-wrapped or not); see the module docstring."""
    result = DecodeCounts()
    counter = OpCounter()
    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = causal_lm.model
    forwards: list[tuple[int, int]] = []  # (rows, new tokens) of the window's forwards
    live: list[int] = []

    def started(_: Any, inputs: tuple[Any, ...]) -> None:
        if not counter.paused:
            forwards.append(tuple(inputs[0].shape[:2]))

    def positions(_: Any, inputs: tuple[Any, ...]) -> None:
        if not counter.paused:
            with counter.pausing():
                live.append(int((inputs[1][:, -1] + 1).sum()))  # the rotation's position ids: [R, T]

    def replayed(replay: Callable[[], torch.Tensor]) -> torch.Tensor:
        """A recorded decode forward: one launch (a CUDA graph's), whatever it runs."""
        with counter.pausing():
            logits = replay()
        counter.counts.compute["graph_replay"] += 1
        result.replays += 1
        close(replay=True)
        return logits

    def close(replay: bool = False) -> None:
        if counter.paused:
            return
        decoding = len(forwards) == 1 and forwards[0][1] == 1  # a replay ran no hooked forward: never
        if decoding:
            result.steps += 1
            result.rows += forwards[0][0]
            result.live_kv_tokens += live[-1]
        (result.replayed_step if replay else result.step if decoding else result.other).add(counter.restart())
        forwards.clear()
        live.clear()

    def into_layers(*_: Any) -> None:
        counter.in_layers = True

    def out_of_layers(*_: Any) -> None:
        counter.in_layers = False

    handles = [
        decoder.embed_tokens.register_forward_pre_hook(started),
        decoder.rotary_emb.register_forward_pre_hook(positions),
        decoder.layers[0].input_layernorm.register_forward_pre_hook(into_layers),
        decoder.layers[0].self_attn.q_proj.register_forward_pre_hook(into_layers),
        decoder.norm.register_forward_pre_hook(out_of_layers),
        causal_lm.lm_head.register_forward_pre_hook(out_of_layers),
        causal_lm.lm_head.register_forward_hook(lambda *_: close()),
    ]
    result.replayed, result.uncounted = replayed, counter.pausing
    try:
        with counter:
            yield result
        close()
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def count_ops() -> Iterator[Counts]:
    """Everything the block dispatches, in one Counts."""
    counter = OpCounter()
    with counter:
        yield counter.counts


def _to_cpu(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether `Tensor.to(*args, **kwargs)` names the CPU as its target, as a string (see the module docstring)."""
    device = kwargs.get("device", next((arg for arg in args if isinstance(arg, str)), None))
    return isinstance(device, str) and torch.device(device).type == "cpu"


def _boolean_index(args: tuple[Any, ...]) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())


def _is_view(func: Any, args: tuple[Any, ...], out: Any) -> bool:
    """A view, or an op that returned its (first) input's storage without writing: no kernel ran. An op that may
    alias (`to`, `contiguous`, `reshape`) is a view only where it did."""
    if func.overloadpacket in METADATA:
        return True
    first = args[0] if args else None
    if isinstance(out, torch.Tensor) and isinstance(first, torch.Tensor) and not func._schema.is_mutable:
        return out.device == first.device and out.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
    return bool(func.is_view)


def _span_bytes(value: Any) -> int:
    """Bytes of the memory a tensor's elements occupy (an expanded dimension counted once)."""
    if not isinstance(value, torch.Tensor):
        return 0
    elements = 1
    for size, stride in zip(value.shape, value.stride(), strict=True):
        elements *= size if stride != 0 else 1
    return elements * value.element_size()


def _bytes_moved(packet: Any, args: tuple[Any, ...], out: Any) -> int:
    """What an eager kernel reads and writes: its tensor inputs and output, except that a gather reads only the
    rows it returns and a scatter writes only the rows it is given (not the whole tensor it indexes)."""
    outputs = sum(_span_bytes(value) for value in tree_flatten(out)[0])
    if packet in ROW_READS:
        index = sum(_span_bytes(value) for value in tree_flatten(args[1:])[0])
        return 2 * outputs + index
    if packet in ROW_WRITES:
        given = sum(_span_bytes(value) for value in tree_flatten(args[1:])[0])
        return 2 * given
    return sum(_span_bytes(value) for value in tree_flatten(args)[0]) + outputs


def _flops(func: Any, packet: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> float:
    """FLOPs of a matmul or attention op (torch.utils.flop_counter's formulas); 0 for the rest."""
    if packet in ATTENTION_FORWARD:
        query, key, value = args[:3]
        flops = flop_counter.sdpa_flop_count(query.shape, key.shape, value.shape)
        return flops / 2 if _causal(func, args, kwargs) else flops
    if packet in ATTENTION_BACKWARD:
        grad, query, key, value = args[:4]
        flops = flop_counter.sdpa_backward_flop_count(grad.shape, query.shape, key.shape, value.shape)
        return flops / 2 if _causal(func, args, kwargs) else flops
    if packet in (aten.linear, aten.matmul):  # in inference mode these reach the counter undecomposed
        return 2.0 * _numel(out) * args[0].shape[-1]
    formula = flop_counter.flop_registry.get(packet)
    if formula is None:
        return 0.0
    return float(formula(*args, **kwargs, out_val=out))


def _numel(value: Any) -> int:
    return value.numel() if isinstance(value, torch.Tensor) else 0


def _causal(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """The attention op's `is_causal` argument, wherever its schema puts it."""
    if "is_causal" in kwargs:
        return bool(kwargs["is_causal"])
    names = [argument.name for argument in func._schema.arguments]
    at = names.index("is_causal")
    return bool(args[at]) if at < len(args) else False
