"""The dispatch counter (retrain/model/counting.py) counts known snippets right, and splits a sampling call into
its decode steps."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from retrain.model.counting import count_decode, count_ops
from retrain.model.spec import ModelSpec
from retrain.types import SamplingParams
from tests.backend.tiny_model import PROMPTS, encode, make_backend, make_engine

MODES = {"inference mode": torch.inference_mode, "grad mode": nullcontext}


@pytest.mark.parametrize("mode", MODES)
def test_one_item_and_one_tensor_from_a_list_count_two_syncs(mode: str) -> None:
    x = torch.arange(6.0)
    with MODES[mode](), count_ops() as counts:
        x.sum().item()
        torch.tensor([1, 2])
    assert (counts.host_reads, counts.host_built, counts.data_dependent) == ({"item": 1}, 1, 0)
    assert counts.syncs == 2
    assert counts.compute == {"sum": 1}


@pytest.mark.parametrize("mode", MODES)
def test_every_kind_of_host_read_counts_once(mode: str) -> None:
    x = torch.arange(6.0)
    with MODES[mode](), count_ops() as counts:
        x.tolist()
        x.numpy()
        x.cpu()
        x.to("cpu", copy=True)
        bool(x.all())
        int(x[0])
        x.to(torch.device("cpu"))  # a device-agnostic `.to(self.device)`: on a CPU not a read (module docstring)
    assert counts.host_reads == {"tolist": 1, "numpy": 1, "to_cpu": 2, "item": 2}
    assert counts.host_built == 0


def test_python_scalars_are_not_host_built_tensors_but_lists_and_list_indices_are() -> None:
    x = torch.arange(6.0)
    with torch.inference_mode(), count_ops() as counts:
        x[0] = 1.0  # a 0-d lift: the scalar goes to the kernel by value
        torch.tensor(3.0)
        torch.as_tensor([1, 2])
        x[[1, 2]]
    assert counts.host_built == 2


def test_boolean_masks_are_data_dependent_shapes_and_integer_indices_are_not() -> None:
    x = torch.arange(6.0)
    with torch.inference_mode(), count_ops() as counts:
        x[x > 2]
        x[torch.arange(2)]
        (x > 2).nonzero()
    assert counts.data_dependent == 2


@pytest.mark.parametrize("mode", MODES)
def test_views_and_casts_with_nothing_to_do_launch_nothing_and_real_casts_do(mode: str) -> None:
    x = torch.ones(3, 4, dtype=torch.bfloat16)
    with MODES[mode](), count_ops() as counts:
        x.view(4, 3).t()
        x.to(torch.bfloat16)
        x.contiguous()
        x.detach()
    assert counts.compute_ops == 0 and counts.views >= 3
    with MODES[mode](), count_ops() as counts:
        x.to(torch.float32)
        x.t().contiguous()
    assert counts.compute_ops == 2


def test_bytes_moved_are_inputs_and_output_but_gathers_and_scatters_count_their_rows() -> None:
    table = torch.zeros(100, 8)
    rows = torch.tensor([3, 5])
    with torch.inference_mode():
        with count_ops() as add:
            torch.ones(4) + torch.ones(4)
        with count_ops() as gather:
            table.index_select(0, rows)
        with count_ops() as scatter:
            table.index_copy_(0, rows, torch.ones(2, 8))
    ones = 2 * 4 * 4  # two ones(4) written
    assert add.bytes_moved == ones + 3 * 16  # each one written, then two read and one written by the add
    assert gather.bytes_moved == 2 * (2 * 8 * 4) + 2 * 8  # the rows read and written, and the index
    assert scatter.bytes_moved == 2 * 8 * 4 + 2 * (2 * 8 * 4 + 2 * 8)  # the ones; index and rows read, rows written


@pytest.mark.parametrize("wants_weight", [False, True])
def test_rms_norm_counts_as_the_fused_kernel_each_way_a_gpu_runs_and_computes_torchs_own(wants_weight: bool) -> None:
    """A CPU runs rms_norm's composite under autograd (~25 ops); CUDA one kernel each way: the input, the weight,
    the output and one fp32 rstd per row forward; the gradient, the input, the weight and the rstd read and the
    gradients written backward."""
    rows, width = 6, 8
    hidden = torch.randn(rows, width, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(width, dtype=torch.bfloat16, requires_grad=wants_weight)
    grad = torch.randn(rows, width, dtype=torch.bfloat16)
    leaves = (hidden, weight) if wants_weight else (hidden,)
    torchs_own = torch.nn.functional.rms_norm
    expected = torch.nn.functional.rms_norm(hidden, (width,), weight, 1e-6)
    expected_grads = torch.autograd.grad(expected, leaves, grad)
    with count_ops() as counts:
        output = torch.nn.functional.rms_norm(hidden, (width,), weight, 1e-6)
        grads = torch.autograd.grad(output, leaves, grad)
    assert counts.compute == {"rms_norm": 1, "rms_norm_backward": 1}
    assert torch.equal(output, expected)
    assert all(torch.equal(a, b) for a, b in zip(grads, expected_grads, strict=True))
    tensor, vector, rstd = rows * width * 2, width * 2, rows * 4
    forward = 2 * tensor + vector + rstd
    backward = 3 * tensor + vector + rstd + (vector if wants_weight else 0)
    assert counts.bytes_moved == counts.plain_bytes == forward + backward
    assert torch.nn.functional.rms_norm is torchs_own  # put back after counting


def test_matmul_and_attention_flops_follow_their_shapes_and_causal_attention_counts_half() -> None:
    with torch.inference_mode(), count_ops() as linear:
        torch.nn.functional.linear(torch.ones(5, 3), torch.ones(4, 3))
    assert linear.flops == 2 * 5 * 3 * 4
    batch, heads, kv_heads, length, dim = 2, 4, 2, 8, 16
    query = torch.randn(batch, heads, length, dim, requires_grad=True)
    key = torch.randn(batch, kv_heads, length, dim, requires_grad=True)
    scores = 2 * batch * heads * length * length * dim  # one of attention's matmuls, every query-key pair
    for causal in (False, True):
        with count_ops() as attention:
            out = torch.nn.functional.scaled_dot_product_attention(query, key, key, is_causal=causal, enable_gqa=True)
            out.sum().backward()
        # 2 matmuls forward, 5 backward (the scores recomputed)
        assert attention.flops == attention.attention_flops == 7 * scores / (2 if causal else 1)
        assert attention.attention_kv_bytes == 2 * key.numel() * 4


def test_attention_over_gathered_keys_and_values_counts_the_gathers_too() -> None:
    """A dense copy of cached keys and values is read and written before attention reads it."""
    pool = torch.randn(32, 2, 16)  # slots, kv heads, head dim
    slots = torch.arange(3, 19)
    query = torch.randn(1, 4, 1, 16)
    with torch.inference_mode(), count_ops() as counts:
        keys, values = (pool.index_select(0, slots).view(1, 16, 2, 16).transpose(1, 2) for _ in range(2))
        torch.nn.functional.scaled_dot_product_attention(query, keys, values, enable_gqa=True)
    dense = 16 * 2 * 16 * 4
    gather = 2 * dense + 16 * 8  # the rows read and written, and the slot indices
    assert counts.attention_kv_bytes == 2 * (gather + dense)


def test_a_sampling_call_splits_into_its_decode_steps() -> None:
    """Each decode step is one forward of one token per row; prefill and the call's tail are counted apart."""
    backend = make_backend(ModelSpec(name_or_path="retrain:tiny_qwen3", lora_rank=4, dtype="bf16"))
    engine = make_engine(backend, merge_lora=False)
    embed = engine.model.get_input_embeddings()
    shapes: list[tuple[int, int]] = []
    handle = embed.register_forward_pre_hook(lambda _, inputs: shapes.append(tuple(inputs[0].shape)))
    with count_decode(engine.model) as decode:
        engine.generate(encode(backend, PROMPTS[:2]), 2, SamplingParams(max_tokens=6, temperature=1.0), 0)
    handle.remove()
    decodes = [rows for rows, width in shapes if width == 1]
    assert decode.steps == len(decodes) > 0 and decode.rows == sum(decodes)
    assert decode.step.layer_compute > 0 and decode.step.compute_ops > decode.step.layer_compute
    assert decode.other.compute_ops > 0  # the prefill and the tail
    layers = engine.model.config.num_hidden_layers
    assert decode.step.compute["scaled_dot_product_attention"] == layers * decode.steps
    assert decode.live_kv_tokens >= decode.rows * min(len(ids) for ids in encode(backend, PROMPTS[:2]))


@pytest.mark.parametrize(("stop_check_steps", "paged_attention"), [(1, "gather"), (8, "gather"), (8, "flex")])
def test_a_decode_step_of_the_gpus_path_makes_its_host_wait_at_most_once_per_two_steps(
    stop_check_steps: int, paged_attention: str
) -> None:
    """The bundled tiny Qwen3 in bf16 with its LoRA unmerged (the GPU's path), rows of different prompt lengths
    that stop at different steps: with the stop flags read once per 8 steps (the GPU's default), a decode step
    reads the device or builds a tensor from host data at most once per two steps, counted through generate(),
    attention reading a gathered copy or the pool through the block tables (flex, the GPU's); read every step,
    once a step at least (the instrument sees the reads)."""
    backend = make_backend(ModelSpec(name_or_path="retrain:tiny_qwen3", lora_rank=4, dtype="bf16"))
    engine = make_engine(backend, merge_lora=False, stop_check_steps=stop_check_steps, paged_attention=paged_attention)
    hot = SamplingParams(max_tokens=48, temperature=2.5, top_p=0.95)  # rows run long and stop apart
    with count_decode(engine.model) as decode:
        rollouts = engine.generate(encode(backend, PROMPTS), 4, hot, 0)
    lengths = rollouts.completion_mask.sum(dim=1)
    assert lengths.min() < lengths.max() and decode.steps >= 12
    per_step = decode.step.syncs / decode.steps
    if stop_check_steps == 8:
        assert per_step <= 0.5, (decode.step.host_reads, decode.step.host_built, decode.step.data_dependent)
    else:
        assert per_step >= 1.0
