"""What one decode step and one training step dispatch, counted on a CPU (a script, not a test).

    python benchmarks/decode_counts.py [--layers 2] [--rows 8] [--group 4] [--prompt-tokens 64] [--new-tokens 16]
                                       [--dtype bf16|fp32] [--lora merged|unmerged] [--config config.json]
                                       [--stop-check-steps 8] [--paged-attention flex|gather]
    python benchmarks/decode_counts.py --model retrain:tiny_qwen3     # a model directory, its own weights
    python benchmarks/decode_counts.py --quick                        # the bundled tiny Qwen3, small sizes

On a GPU an eager decode step costs a launch per op and a stall per host sync whatever the batch, and decode
is bound by the bytes it moves; none of that shows in a CPU's timings, but the ops do. The model is any
config.json's (default Qwen3-4B-Instruct-2507's shipped config, `--layers` of its decoder layers) with random
bf16 weights and a byte-level tokenizer of its vocabulary (benchmarks/_real_scale_model.py), loaded as a run
loads a model: ModelSpec, LocalBackend, `inference=pytorch` from the composed config. The rows' prompts have
lengths spread over [prompt-tokens / 2, prompt-tokens]; a counted `generate()` (retrain/model/counting.py)
reports per decode step: compute ops ÷ layers, views, host reads / host-built tensors / data-dependent shapes,
the bytes its eager ops move per generated token against the roofline's (every weight read once per step,
LoRA A/B included, each row's live KV read and its new KV written), and the bytes of the keys and values the
attention reads (with the gathers that copied them out of the KV pool) against the live KV. Then one counted `train()` over the sampled rows, their completions cut to lengths
spread over [new-tokens / 4, new-tokens]: the positions its forwards ran against the tokens (a group's prompt
once), and FLOPs executed against the causal FLOPs needed (benchmarks/_speed_bounds.py, causal_training_flops),
and the bytes moved by its ops that do no matmul or attention FLOPs (a GPU kernel each: casts, norms, the rotary
embedding, activations, residual adds, their backward; the norms, the rotary embedding and SiLU·up counted as a
GPU's fused kernels, `backend.fused_elementwise` as its auto sets it): with the FLOPs at an H200's peak and those
bytes at its copy bandwidth, the MFU ceiling these ops leave (the LM head's share shrinks with `--layers`).
Last, one forward of the same rows without autograd through each training layout (`backend.train_attention`:
mask, and flex, whose backward the CPU lacks): attention's FLOPs executed against the causal ones, and the
share of its positions that held padding.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from _real_scale_model import qwen3_4b_config, write_random_model  # benchmarks/ is sys.path[0] as a script
from _speed_bounds import causal_attention_flops, causal_training_flops
from omegaconf import OmegaConf
from torch.fx.experimental.proxy_tensor import make_fx

from retrain.backend.settings import LossSettings, OptimSettings
from retrain.config import TrainingConfig, compose
from retrain.inference.sampler.step_graphs import Step
from retrain.model.counting import Counts, DecodeCounts, count_decode, count_ops
from retrain.model.logprobs import ForwardTokens, completion_logprobs
from retrain.run import build_part
from retrain.types import SamplingParams, TrainBatch

H200_PEAK_FLOPS = 989e12  # dense bf16, as real_scale.py counts MFU
H200_COPY_BANDWIDTH = 4.276e12  # bytes/s of a large copy, measured by real_scale.py on the lent H200
QUICK = ["--model", "retrain:tiny_qwen3", "--rows", "4", "--group", "2", "--prompt-tokens", "16", "--new-tokens", "8"]
FIRST_ID = 40  # prompt ids: byte tokens from here on, never a special token of the tokenizers written or bundled


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, help="a config.json (default: Qwen3-4B-Instruct-2507's)")
    parser.add_argument("--model", help="a model directory or retrain:tiny_qwen3, its own weights (not --config)")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers kept of --config's (0: all)")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--group", type=int, default=4, help="completions per prompt (rows / group prompts)")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--lora", choices=("merged", "unmerged"), default="unmerged")
    parser.add_argument("--lora-rank", type=int, default=32)
    parser.add_argument(
        "--stop-check-steps", type=int, default=8, help="inference.stop_check_steps (8: the GPU's automatic value)"
    )
    parser.add_argument(
        "--paged-attention",
        choices=("flex", "gather"),
        default="flex",
        help="inference.paged_attention (flex: the GPU's automatic value)",
    )
    parser.add_argument("--quick", action="store_true", help=f"shorthand for {' '.join(QUICK)}")
    parser.add_argument("--out", type=Path, help="also write the numbers as JSON")
    args = parser.parse_args()
    if args.quick:  # the options given after it win
        args = parser.parse_args([*QUICK, *sys.argv[1:]])
    if args.model and args.config:
        parser.error("--model and --config exclude each other")
    if args.rows % args.group:
        parser.error("--rows must be a multiple of --group")
    logging.basicConfig(level=logging.WARNING)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or _written_model(Path(tmp), args.config, args.layers)
        results = measure(model, args)
    if not args.model:
        results["model"] = f"{args.config or 'Qwen3-4B-Instruct-2507 config.json'} (random weights)"
    print_results(results)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


def _written_model(directory: Path, config: Path | None, layers: int) -> str:
    values = qwen3_4b_config() if config is None else json.loads(config.read_text())
    if layers:
        values["num_hidden_layers"] = layers
        if isinstance(values.get("layer_types"), list):
            values["layer_types"] = values["layer_types"][:layers]
    write_random_model(directory, values, "cpu")
    return str(directory)


def measure(model_name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Build the parts, count one sampling call and one training step; the numbers, by name."""
    cfg = compose(
        [
            f"model.name_or_path={model_name}",
            f"model.dtype={args.dtype}",
            f"model.lora_rank={args.lora_rank}",
            "backend=local",
            "backend.devices=cpu",
            "backend.fused_elementwise=true",  # as a GPU's auto: counted as its kernels, compiled never
            "inference=pytorch",
            f"inference.merge_lora={args.lora == 'merged'}",
            f"inference.stop_check_steps={args.stop_check_steps}",
            f"inference.paged_attention={args.paged_attention}",
        ]
    )
    training: TrainingConfig = OmegaConf.to_object(cfg.training)  # type: ignore[assignment]
    spec = build_part(cfg, "model")
    tokenizer = spec.load_tokenizer()
    backend = build_part(
        cfg,
        "backend",
        model=spec,
        optim=OptimSettings.from_config(training),
        loss=LossSettings.from_config(training),
        seed=0,
    )
    engine = build_part(cfg, "inference", tokenizer=tokenizer, resources=backend.engine_resources())
    prompts = args.rows // args.group
    prompt_ids = [
        [FIRST_ID + (7 * index + 3 * at) % 200 for at in range(length)]
        for index, length in enumerate(_spread(prompts, args.prompt_tokens // 2, args.prompt_tokens))
    ]
    sampling = SamplingParams(max_tokens=args.new_tokens, temperature=1.0)
    engine.generate(prompt_ids, args.group, SamplingParams(max_tokens=2, temperature=1.0), 0)  # warm-up
    with count_decode(engine.model) as decode:
        rollouts = engine.generate(prompt_ids, args.group, sampling, 1)
    replayed = _replayed_steps(engine, prompt_ids, args.group, sampling) if args.paged_attention == "flex" else {}
    model_config = engine.model.config
    layers = model_config.num_hidden_layers
    weights = weight_bytes(engine.model)
    kv_token = engine.kv_shape.layers * 2 * engine.kv_shape.kv_heads * engine.kv_shape.head_dim
    kv_token_bytes = kv_token * engine.kv_shape.dtype.itemsize
    batch, completion_lengths = train_batch(rollouts, args.new_tokens)
    positions: list[int] = []  # the training forwards' [rows, width] inputs, padding included
    embedding = backend.engine_resources().model.get_input_embeddings()
    handle = embedding.register_forward_pre_hook(lambda _, inputs: positions.append(inputs[0].numel()))
    with count_ops() as training_counts:
        backend.train(batch)
    handle.remove()
    forwards = {
        documents: training_forward(backend.engine_resources().model, batch, args.group, documents)
        for documents in (False, True)
    }
    adapter = sum(p.numel() for p in backend.engine_resources().model.parameters() if p.requires_grad)
    prompt_lengths = rollouts.prompt_mask.sum(dim=1).tolist()
    groups = [completion_lengths[at : at + args.group] for at in range(0, args.rows, args.group)]
    needed = causal_training_flops(model_config, adapter, prompt_lengths, groups)
    attention_needed = causal_attention_flops(model_config, prompt_lengths, groups)
    return {
        "model": model_name,
        "layers": layers,
        "dtype": args.dtype,
        "lora": args.lora,
        "rows": args.rows,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        **decode_numbers(decode, layers, weights, kv_token_bytes),
        **replayed,
        "train_tokens": int(sum(prompt_lengths) + sum(completion_lengths)),
        "train_positions": sum(positions),
        "train_flops_executed": training_counts.flops,
        "train_flops_needed": needed,
        "train_attention_flops_executed": training_counts.attention_flops,
        "train_attention_flops_needed": attention_needed,
        "train_compute_ops": training_counts.compute_ops,
        "train_syncs": training_counts.syncs,
        "train_plain_bytes": training_counts.plain_bytes,
        "train_plain_bytes_top": dict(training_counts.plain_bytes_by_op.most_common(8)),
        "train_mfu_ceiling_h200": training_mfu_ceiling(training_counts, needed),
        # one forward of the same rows without autograd, each layout (flex_attention has no CPU backward)
        **{
            f"forward_{'flex' if documents else 'mask'}_{key}": value
            for documents, (counts, tokens) in forwards.items()
            for key, value in (
                ("attention_flops_executed", counts.attention_flops),
                ("padding_frac", 1 - float(tokens.real) / tokens.computed),
            )
        },
        "forward_attention_flops_needed": attention_needed * 2 / 7,  # 2 of its 7 matmuls run forward
    }


def training_mfu_ceiling(counts: Counts, needed_flops: float) -> float:
    """The MFU a training step with these ops could reach at best on an H200: every FLOP at the bf16 peak, every
    byte of the ops without FLOPs (elementwise, casts, reductions: a GPU kernel each) at the copy bandwidth measured
    there, one after the other; against the FLOPs needed, as real_scale.py counts MFU."""
    seconds = counts.flops / H200_PEAK_FLOPS + counts.plain_bytes / H200_COPY_BANDWIDTH
    return needed_flops / H200_PEAK_FLOPS / seconds


def _replayed_steps(engine: Any, prompt_ids: list[list[int]], group: int, sampling: SamplingParams) -> dict[str, Any]:
    """The same call with its decode forwards recorded once per row bucket and replayed (inference.cuda_graphs,
    a GPU's automatic choice): a replayed step's launches, the replay counted as one. On a CPU torch's tracer
    (make_fx) records in CUDA's stead, as tests/inference/test_step_graphs.py does; the recording launches
    nothing. The pool is reserved at the size all rows need (a recorded step needs it fixed)."""
    rows = len(prompt_ids) * group
    blocks = rows * (engine.kv_shape.blocks_for(max(map(len, prompt_ids)) + sampling.max_tokens) + 1) + 2
    budget = blocks * engine.kv_shape.block_bytes / 2**30
    saved_budget, saved_recorder = engine.kv_cache_gb, engine.step_recorder
    with count_decode(engine.model) as decode:

        def record(step: Step) -> tuple[torch.Tensor, Step]:
            first = step()
            with decode.uncounted():
                graph = make_fx(step)()
            return first, lambda: decode.replayed(graph)

        engine.kv_cache_gb, engine.step_recorder = budget, lambda: record
        try:
            engine.generate(prompt_ids, group, sampling, 1)
        finally:
            engine.kv_cache_gb, engine.step_recorder = saved_budget, saved_recorder
    if not decode.replays:
        raise RuntimeError("no decode step was replayed: the recording failed (see the warning above)")
    counts = decode.replayed_step
    return {
        "replayed_steps": decode.replays,
        "replayed_launches_per_step": counts.compute_ops / decode.replays,
        "replayed_graphs_per_step": counts.compute["graph_replay"] / decode.replays,
        "replayed_syncs_per_step": counts.syncs / decode.replays,
        "replayed_top_ops": {name: count / decode.replays for name, count in counts.compute.most_common(8)},
    }


def training_forward(model: Any, batch: TrainBatch, group: int, documents: bool) -> tuple[Counts, ForwardTokens]:
    """Counted log-probs of the batch's rows in one forward without autograd, through the document layout
    (flex_attention over a block mask) or the mask layout (packed groups or a shared prefill)."""
    rollouts = batch.rollouts
    width = int(rollouts.completion_mask.sum(dim=1).max())
    tokens = ForwardTokens()
    arguments = (
        rollouts.prompt_ids,
        rollouts.prompt_mask,
        torch.arange(rollouts.completion_mask.shape[0]) // group,
        rollouts.completion_ids[:, :width],
        rollouts.completion_mask[:, :width],
    )
    with torch.no_grad(), count_ops() as counts:
        completion_logprobs(model, *arguments, rollouts.temperature, documents=documents, tokens=tokens)
    return counts, tokens


def decode_numbers(decode: DecodeCounts, layers: int, weights: int, kv_token_bytes: int) -> dict[str, Any]:
    """Per decode step (and per generated token for bytes), from the counted call."""
    step, other = decode.step, decode.other
    steps = max(1, decode.steps)
    tokens = max(1, decode.rows)
    # roofline: every weight once per step, each row's live KV read, its new KV written
    roofline = decode.steps * weights + decode.live_kv_tokens * kv_token_bytes + decode.rows * kv_token_bytes
    return {
        "decode_steps": decode.steps,
        "rows_per_step": decode.rows / steps,
        "live_kv_tokens_per_row": decode.live_kv_tokens / tokens,
        "ops_per_step_per_layer": step.compute_ops / steps / layers,
        "layer_ops_per_layer": step.layer_compute / steps / layers,
        "other_ops_per_step": (step.compute_ops - step.layer_compute) / steps,
        "views_per_step": step.views / steps,
        "host_reads_per_step": _reads(step, steps),
        "host_built_per_step": step.host_built / steps,
        "data_dependent_per_step": step.data_dependent / steps,
        "syncs_per_step": step.syncs / steps,
        "syncs_outside_steps": other.syncs,
        "bytes_per_token": step.bytes_moved / tokens,
        "roofline_bytes_per_token": roofline / tokens,
        "attention_kv_bytes_per_token": step.attention_kv_bytes / tokens,
        "live_kv_bytes_per_token": decode.live_kv_tokens * kv_token_bytes / tokens,
        "top_ops_per_step": {name: count / steps for name, count in step.compute.most_common(12)},
    }


def _reads(counts: Counts, steps: int) -> dict[str, float]:
    return {kind: count / steps for kind, count in sorted(counts.host_reads.items())}


def weight_bytes(model: Any) -> int:
    """Bytes of the parameters one forward reads: each storage once (a tied LM head and embedding are one), the
    input embedding's table left out where it is not the LM head's (a forward gathers a few rows of it)."""
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    seen: set[int] = set()
    total = 0
    for parameter in model.parameters():
        pointer = parameter.data_ptr()
        if pointer in seen or (parameter is embedding and embedding.data_ptr() != head.data_ptr()):
            continue
        seen.add(pointer)
        total += parameter.numel() * parameter.element_size()
    return total


def train_batch(rollouts: Any, new_tokens: int) -> tuple[TrainBatch, list[int]]:
    """The sampled rows, row i's completion cut to a length spread over [new_tokens / 4, new_tokens] (padding
    as an RL batch has it), advantages ±1 alternating by row; the batch and the completion lengths."""
    rows = rollouts.completion_mask.shape[0]
    sampled = rollouts.completion_mask.sum(dim=1).tolist()
    lengths = [min(want, have) for want, have in zip(_spread(rows, max(1, new_tokens // 4), new_tokens), sampled)]
    mask = torch.arange(rollouts.completion_mask.shape[1]) < torch.tensor(lengths).unsqueeze(-1)
    sign = torch.tensor([1.0 if row % 2 == 0 else -1.0 for row in range(rows)]).unsqueeze(-1)
    batch = TrainBatch(
        replace(rollouts, completion_mask=mask), advantages=sign * mask, row_mask=torch.ones(rows, dtype=torch.bool)
    )
    return batch, lengths


def _spread(count: int, low: int, high: int) -> list[int]:
    """`count` lengths from `high` down to `low`, evenly spread."""
    if count == 1:
        return [high]
    return [round(high - (high - low) * index / (count - 1)) for index in range(count)]


def print_results(results: dict[str, Any]) -> None:
    print(
        f"{results['model']}: {results['layers']} layers, {results['dtype']}, LoRA {results['lora']}; "
        f"{results['rows']} rows, prompts ≤ {results['prompt_tokens']} tokens, {results['new_tokens']} new tokens"
    )
    reads = ", ".join(f"{kind} {value:.2f}" for kind, value in results["host_reads_per_step"].items())
    attention = results["attention_kv_bytes_per_token"] / max(1, results["live_kv_bytes_per_token"])
    lines = [
        ("decode steps counted", f"{results['decode_steps']}"),
        (
            "rows per step; live KV tokens per row",
            f"{results['rows_per_step']:.1f}; {results['live_kv_tokens_per_row']:.1f}",
        ),
        ("compute ops per step ÷ layers", f"{results['ops_per_step_per_layer']:.1f}"),
        ("  inside the layers, per layer", f"{results['layer_ops_per_layer']:.1f}"),
        ("  outside the layers, per step", f"{results['other_ops_per_step']:.1f}"),
        ("views per step (no kernel)", f"{results['views_per_step']:.1f}"),
        ("host reads per step", f"{sum(results['host_reads_per_step'].values()):.2f} ({reads})"),
        ("host-built tensors per step", f"{results['host_built_per_step']:.2f}"),
        ("data-dependent shapes per step", f"{results['data_dependent_per_step']:.2f}"),
        ("host syncs per step (all three)", f"{results['syncs_per_step']:.2f}"),
        ("host syncs outside the steps, per call", f"{results['syncs_outside_steps']}"),
        ("bytes moved per token (eager ops)", _bytes(results["bytes_per_token"])),
        ("roofline bytes per token", _bytes(results["roofline_bytes_per_token"])),
        ("  eager / roofline", f"{results['bytes_per_token'] / results['roofline_bytes_per_token']:.2f}×"),
        ("attention's K/V bytes per token (gather + read)", _bytes(results["attention_kv_bytes_per_token"])),
        ("live KV per token", _bytes(results["live_kv_bytes_per_token"])),
        ("  attention's K/V bytes / live KV", f"{attention:.2f}×"),
        ("training: tokens (prompts once + completions)", f"{results['train_tokens']}"),
        ("training: positions its forwards ran (padding in)", f"{results['train_positions']}"),
        ("training: FLOPs executed", f"{results['train_flops_executed']:.3g}"),
        ("training: causal FLOPs needed", f"{results['train_flops_needed']:.3g}"),
        ("  executed / needed", f"{results['train_flops_executed'] / results['train_flops_needed']:.2f}×"),
        ("  attention alone: executed / needed", _ratio(results, "train_attention_flops")),
        ("training: compute ops; host syncs", f"{results['train_compute_ops']}; {results['train_syncs']}"),
        ("training: bytes moved by the ops without FLOPs", _bytes(results["train_plain_bytes"])),
        ("  MFU ceiling on an H200 with these ops", f"{results['train_mfu_ceiling_h200']:.1%}"),
        ("one forward, attention executed / needed: mask", _forward_ratio(results, "mask")),
        ("  flex (documents)", _forward_ratio(results, "flex")),
        (
            "  padding of its positions: mask; flex",
            f"{results['forward_mask_padding_frac']:.2f}; {results['forward_flex_padding_frac']:.2f}",
        ),
    ]
    if "replayed_steps" in results:
        lines += [
            ("decode steps replayed (inference.cuda_graphs)", f"{results['replayed_steps']}"),
            ("  launches per replayed step (the graph: 1)", f"{results['replayed_launches_per_step']:.1f}"),
            ("  host syncs per replayed step", f"{results['replayed_syncs_per_step']:.2f}"),
        ]
    width = max(len(name) for name, _ in lines)
    for name, value in lines:
        print(f"{name:<{width}}  {value}")
    top = ", ".join(f"{name} {count:.1f}" for name, count in results["top_ops_per_step"].items())
    print(f"most frequent ops per step: {top}")
    if "replayed_top_ops" in results:
        top = ", ".join(f"{name} {count:.1f}" for name, count in results["replayed_top_ops"].items())
        print(f"most frequent launches per replayed step: {top}")
    plain = results["train_plain_bytes"]
    top = ", ".join(f"{name} {moved / plain:.0%}" for name, moved in results["train_plain_bytes_top"].items())
    print(f"training: the bytes of the ops without FLOPs, by op: {top}")


def _ratio(results: dict[str, Any], key: str) -> str:
    executed, needed = results[f"{key}_executed"], results[f"{key}_needed"]
    return f"{executed:.3g} / {needed:.3g} = {executed / needed:.2f}×"


def _forward_ratio(results: dict[str, Any], layout: str) -> str:
    executed, needed = results[f"forward_{layout}_attention_flops_executed"], results["forward_attention_flops_needed"]
    return f"{executed:.3g} / {needed:.3g} = {executed / needed:.2f}×"


def _bytes(value: float) -> str:
    if value >= 1e6:
        return f"{value / 1e6:,.2f} MB"
    return f"{value / 1e3:,.1f} kB" if value >= 1e3 else f"{value:.0f} B"


if __name__ == "__main__":
    main()
